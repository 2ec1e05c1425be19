"""OpenAI-compatible HTTP edge over any `ServingBackend` (`build_app(backend)`).

Endpoints:
    POST /v1/completions        prompt: text or token ids; streaming (SSE) or not
    POST /v1/chat/completions   messages -> one prompt through the checkpoint's chat template
                                (`chat_template`); `tools` / `tool_choice` (`tool_calls`, `structured`)
    POST /tokenize, /detokenize vLLM's: {prompt | messages} -> {count, max_model_len, tokens};
                                {tokens} -> {prompt}
Structured output on both completion routes: `response_format` json_object / json_schema, vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` / `structured_outputs` (`structured`).
    GET  /v1/models             the served model
    GET  /health                200 {"status": "ok"}; 503 naming why when the backend's check_ready() raises
                                BackendUnavailable (or "the server is starting", while `app.state.starting`:
                                `orchestrator.serve`). No call to any instance: it answers at once, from the
                                health the cluster last recorded, even while an instance stalls
    GET  /metrics               Prometheus text (pdcluster/orchestrator/api/metrics.py lists every metric)

The package by concept: `protocol` (request schemas, error and response bodies), `chat_template`,
`structured` (grammars of a request), `tool_calls` (DeepSeek-V3's format), `errors`, `generation` (checks
against the served model, one request's bookkeeping, stop strings at the edge), `sse` (streaming and
client disconnects), `guard` (API key, admission, body size), `metrics`, `server` (`ServerThread`,
`python -m pdcluster.orchestrator.api`), and this module (the app and its routes).

Access and limits (`guard.EdgeGuard`, checked before a request's body is read; `build_app`'s arguments,
from the YAML's `api` section under `pdcluster deploy`):
- `api_key`: every path needs `Authorization: Bearer <api_key>` (401 otherwise), the interactive docs
  and the schema included (/docs, /redoc, /openapi.json: they describe the API to whoever asks), except
  /health and /metrics. Those stay open on purpose: a load balancer's or orchestrator's liveness probe
  and a Prometheus scraper carry no token, and neither reveals prompts, outputs or the key (/health says
  ok or which instance is down and why; /metrics has counts, latencies and KV block usage per instance).
  Where that is too much, bind `api.host` to a private interface or put a proxy in front.
- `max_concurrent_requests`: completion requests in flight at most (admitted, response not ended); one
  more is answered 429 with `Retry-After` before its stream starts, never a 200 with an error inside.
  Past the edge, the cluster queues what it admitted (prefill queue, decode's wait for a KV reservation
  or a seat in the batch).
- `max_request_body_bytes`: a larger body is answered 413 (a declared Content-Length at once, a chunked
  body as soon as it passes the limit) and the connection closed, the rest unread.

Prompts are tokenized on worker threads (`TOKENIZER_THREADS`, in the tokenizer's form that releases the
GIL), so a multi-MB prompt does not hold up the event loop: /health and every other stream go on.

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON, a
schema violation, text that is not valid Unicode (the message names the field, the code point and its
index), unsupported options (suffix, echo with logprobs), out-of-range n / best_of / logprobs /
top_logprobs, a grammar that does not compile (naming the field), a bad sampling value, a prompt or prompt +
max_tokens over the context; 404 for an unknown model; 401 for a missing or wrong API key; 413 for a body
over the limit; 429 when the edge is full and 503 when the backend raises `BackendUnavailable` (both with
`Retry-After: RETRY_AFTER_S`). An error after an SSE stream started is sent as a final
`data: {"error": ...}` event, then `data: [DONE]`.

Every response carries `usage` (prompt/completion/total tokens) and a `pdcluster` extension:
    {"request_id", "phases": {queue_s, prefill_s, kv_transfer_s, first_decode_step_s, total_s, ...},
     "ttft_s", "tpot_s", "e2e_s", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
     "acceptance_rate_per_position", "ranks" (the serving ranks, on a cluster)}
`phases` are the backend's (seconds); a phase the backend does not report is filled from what the edge saw
(first_decode_step_s: first -> second token delta; total_s: the edge's e2e), `ttft_s`/`tpot_s`/`e2e_s` are
measured at the edge. In a stream it rides on the last chunk (the one with `finish_reason`).

A client that disconnects (before the first byte, mid-stream, or while a non-streaming request runs) has
its request aborted in the backend, which frees its KV blocks and reservations at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdcluster.orchestrator.api.chat_template import ChatTemplate, ChatTemplateError
from pdcluster.orchestrator.api.choices import serve_choices
from pdcluster.orchestrator.api.errors import add_error_handlers
from pdcluster.orchestrator.api.generation import Generation, PreparedRequest, prepare
from pdcluster.orchestrator.api.guard import EdgeGuard
from pdcluster.orchestrator.api.metrics import ApiMetrics
from pdcluster.orchestrator.api.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    Endpoint,
    TokenizeRequest,
    Tool,
    logit_bias,
    num_top_logprobs,
    reject_unsupported,
    response_body,
    usage_chunk,
)
from pdcluster.orchestrator.api.sse import DISCONNECTED, SSEResponse, sse_events, until_disconnect
from pdcluster.orchestrator.api.structured import EdgeGrammars, requested_grammar
from pdcluster.orchestrator.api.tool_calls import (
    ToolCallMarkers,
    ToolCallStream,
    markers_for,
    parse_tool_calls,
)
from pdcluster.orchestrator.backend import BackendUnavailable, ServingBackend
from pdcluster.orchestrator.topology import DEFAULT_MAX_REQUEST_BODY_BYTES, SLOConfig, Topology

TOKENIZER_THREADS = 2  # worker threads tokenizing prompts (off the event loop), per app


def build_topology_app(backend: ServingBackend, topology: Topology) -> FastAPI:
    """`build_app` over `backend` with `topology`'s API settings: its api key, SLO, request-body limit and
    limit on concurrent requests (`Topology.max_concurrent_requests`). Raises as `build_app`."""
    return build_app(
        backend,
        api_key=topology.api.api_key,
        slo=topology.slo,
        max_request_body_bytes=topology.api.max_request_body_bytes,
        max_concurrent_requests=topology.max_concurrent_requests,
    )


def build_app(
    backend: ServingBackend,
    api_key: str | None = None,
    slo: SLOConfig | None = None,
    *,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_concurrent_requests: int | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over `backend` (see the module docstring). State lives on the app.

    Args:
        api_key: bearer token for every path but /health and /metrics; None: no authentication.
        slo: TTFT/TPOT targets (milliseconds) counted in `pdcluster_slo_requests_total`; None: not counted.
        max_request_body_bytes: a larger request body is answered 413, unread (`EdgeGuard`).
        max_concurrent_requests: completion requests in flight at most; beyond it 429 with `Retry-After`
            before the stream starts. None: no limit (`orchestrator.serve` passes the topology's,
            `Topology.max_concurrent_requests`).

    Raises:
        ValueError: a limit below 1, or an empty api_key (it would let an empty bearer token in).
    """
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key must not be empty (None: no authentication)")
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
    if max_concurrent_requests is not None and max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests must be >= 1 or None, got {max_concurrent_requests}")
    app = FastAPI(title="pdcluster", version="0.1.0")
    metrics = ApiMetrics(backend.stats)
    app.state.backend = backend
    app.state.metrics = metrics
    app.add_middleware(
        EdgeGuard,
        api_key=api_key,
        max_request_body_bytes=max_request_body_bytes,
        max_concurrent_requests=max_concurrent_requests,
        metrics=metrics,
    )
    # Tokenizing a long prompt takes seconds: done here, the event loop (/health, every stream) goes on.
    # Its own threads, so a queue of long prompts does not hold up /metrics' stats() in the default pool.
    tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
    app.state.tokenizer_pool = tokenizer_pool

    def encode_off_the_gil(text: str) -> list[int]:
        # `tokenizers`' single `encode` holds the GIL throughout (seconds for a few MB: the event loop
        # would stall even on another thread); its batch form releases it while the Rust code runs.
        return backend.tokenizer.encode_batch([text])[0]

    async def encode(text: str) -> list[int]:
        """`text`'s token ids, tokenized on `tokenizer_pool`.

        Raises:
            ValueError: invalid Unicode. ApiError: 400 at once, untokenized, for a text with more characters
                than `max_model_len` tokens can hold (`Tokenizer.max_token_chars` each): tokenizing a few
                MB takes seconds of the pool that other requests' prompts wait for.
        """
        max_chars = backend.tokenizer.max_token_chars  # (cached: the vocabulary is read once)
        if len(text) > backend.max_model_len * max_chars:
            raise ApiError(
                400,
                f"the prompt has {len(text):,} characters, so at least {-(-len(text) // max_chars):,} tokens "
                f"(a token holds at most {max_chars} characters): more than max_model_len "
                f"{backend.max_model_len}",
                param="prompt",
            )
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, encode_off_the_gil, text)

    add_error_handlers(app, metrics)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if getattr(request.app.state, "starting", False):  # `orchestrator.serve`: listening, not yet serving
            raise ApiError(503, "the server is starting", "service_unavailable")
        try:
            backend.check_ready()  # bookkeeping only: on the event loop, answered at once
        except BackendUnavailable as exc:
            raise ApiError(503, str(exc), "service_unavailable") from exc
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        # The collector reads backend.stats(), which may wait for a call timeout: off the event loop.
        text = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": backend.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdcluster",
                        "max_model_len": backend.max_model_len,
                    }
                ],
            }
        )

    chat_template = ChatTemplate(backend.tokenizer)
    tool_markers = markers_for(chat_template.template_text(with_tools=True))
    grammars = EdgeGrammars(backend)

    def render_chat(
        messages: list[ChatMessage], tools: list[Tool] | None, add_generation_prompt: bool
    ) -> str:
        try:
            return chat_template.render(
                [m.for_template() for m in messages],
                [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                add_generation_prompt,
            )
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    async def with_grammar(
        prepared: PreparedRequest, body: CompletionRequest | ChatCompletionRequest
    ) -> None:
        """Compile the request's grammar (400 naming the field if it does not) and set it on `prepared`."""
        grammar, param = requested_grammar(body, tool_markers)
        if grammar is not None:
            await asyncio.get_running_loop().run_in_executor(tokenizer_pool, grammars.check, grammar, param)
            prepared.params = dataclasses.replace(prepared.params, structured_output=grammar)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        reject_unsupported(body)
        if isinstance(body.prompt, str):
            prompt_ids = await encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        echo_text = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else None
        if echo_text is None:
            echo_text = backend.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        prepared = prepare(
            backend,
            body,
            prompt_ids,
            body.max_tokens,
            default_max_tokens=16,
            prefix="cmpl",
            num_top_logprobs=num_top_logprobs(body),
            logit_bias=logit_bias(body),
            echo_text=echo_text,
        )
        await with_grammar(prepared, body)
        return await serve_one(request, prepared, body, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        reject_unsupported(body)
        prompt_ids = await encode(render_chat(body.messages, body.tools, body.add_generation_prompt))
        completion_limit = body.max_completion_tokens is not None  # OpenAI's newer name wins
        prepared = prepare(
            backend,
            body,
            prompt_ids,
            body.max_completion_tokens if completion_limit else body.max_tokens,
            default_max_tokens=None,
            prefix="chatcmpl",
            max_tokens_param="max_completion_tokens" if completion_limit else "max_tokens",
            num_top_logprobs=num_top_logprobs(body),
            logit_bias=logit_bias(body),
        )
        await with_grammar(prepared, body)
        parse_tools = bool(body.tools) and body.tool_choice != "none"
        return await serve_one(request, prepared, body, "chat", tool_markers if parse_tools else None)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        """vLLM's /tokenize: `prompt`, or `messages` through the chat template."""
        _check_model(backend, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either prompt or messages", param="prompt")
        text = (
            body.prompt
            if body.prompt is not None
            else render_chat(body.messages, body.tools, body.add_generation_prompt)
        )
        tokens = await encode(text)
        return JSONResponse({"count": len(tokens), "max_model_len": backend.max_model_len, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        """vLLM's /detokenize: the text of `tokens` (special tokens skipped)."""
        _check_model(backend, body.model)
        vocab_size = getattr(backend, "vocab_size", None) or backend.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab_size}), got {bad[0]}", param="tokens")
        return JSONResponse({"prompt": backend.tokenizer.decode(body.tokens)})

    async def serve_one(
        request: Request,
        prepared: PreparedRequest,
        body: CompletionRequest | ChatCompletionRequest,
        endpoint: Endpoint,
        tool_markers: ToolCallMarkers | None = None,
    ) -> Response:
        best_of = getattr(body, "best_of", None) or body.n
        if best_of > 1:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            start = partial(Generation, backend, metrics=metrics, slo=slo)
            return await serve_choices(
                request, prepared, start, endpoint, body.n, best_of, body.stream, include_usage
            )
        gen = Generation(backend, prepared, metrics, slo)
        # Wait for the first delta before answering, so a request the backend refuses gets a real 400/503
        # instead of an error event inside a 200 stream. On the cluster the first delta is the prefill
        # reply's first token (`orchestrator.dispatch.EmitFirstToken`): a handoff that fails after it and
        # cannot be re-dispatched (`next_action`) ends the stream with an error event instead.
        try:
            first = await until_disconnect(request, gen.next())
        except BaseException:
            await gen.close()
            raise
        if first is DISCONNECTED:
            await gen.close()
            return Response(status_code=499)
        if body.stream:
            chunk = partial(_chunk, endpoint) if tool_markers is None else _tool_chunk(tool_markers)
            usage = partial(usage_chunk, endpoint=endpoint)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(sse_events(gen, chunk, usage if include_usage else None), on_close=gen.close)
        try:
            result = await until_disconnect(request, gen.drain())
        finally:
            await gen.close()
        if result is DISCONNECTED:
            return Response(status_code=499)
        p = gen.progress
        if tool_markers is None:
            return JSONResponse(response_body(gen, endpoint, p.text, p.finish_reason, chunk=False))
        content, calls = parse_tool_calls(p.text, tool_markers)
        finish = "tool_calls" if calls and p.finish_reason == "stop" else p.finish_reason
        tool_calls = [c.to_openai() for c in calls]
        return JSONResponse(response_body(gen, endpoint, content, finish, chunk=False, tool_calls=tool_calls))

    return app


def _check_model(backend: ServingBackend, model: str | None) -> None:
    if model is not None and model != backend.model_name:
        raise ApiError(
            404, f"unknown model {model!r}; this server serves {backend.model_name!r}", param="model"
        )


def _chunk(endpoint: Endpoint, gen: Generation, text: str, finish: str | None, first: bool) -> dict:
    return response_body(gen, endpoint, text, finish, chunk=True, first=first)


def _tool_chunk(markers: ToolCallMarkers) -> Callable[[Generation, str, str | None, bool], dict]:
    """A chat chunk builder that sends tool calls as `tool_calls` deltas (`ToolCallStream`) and ends with
    finish_reason "tool_calls" when the model called one."""
    parser = ToolCallStream(markers)

    def chunk(gen: Generation, text: str, finish: str | None, first: bool) -> dict:
        content, calls = parser.feed(text, final=finish is not None)
        if finish == "stop" and parser.num_calls:
            finish = "tool_calls"
        return response_body(gen, "chat", content, finish, chunk=True, first=first, tool_calls=calls or None)

    return chunk
