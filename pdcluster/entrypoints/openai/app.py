"""OpenAI-compatible HTTP edge over any `ServingBackend` (`build_app(backend)`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdcluster.config import DEFAULT_MAX_REQUEST_BODY_BYTES, SLOConfig, Topology
from pdcluster.driver.backend import BackendUnavailable, ServingBackend
from pdcluster.entrypoints.openai.admin import add_admin_routes
from pdcluster.entrypoints.openai.admin import admin_token as resolve_admin_token
from pdcluster.entrypoints.openai.chat_template import ChatTemplate, ChatTemplateError
from pdcluster.entrypoints.openai.choices import serve_choices, serve_prompts
from pdcluster.entrypoints.openai.errors import add_error_handlers
from pdcluster.entrypoints.openai.generation import Generation, PreparedRequest, prepare
from pdcluster.entrypoints.openai.guard import EdgeGuard
from pdcluster.entrypoints.openai.metrics import ApiMetrics
from pdcluster.entrypoints.openai.protocol import (
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
from pdcluster.entrypoints.openai.sse import DISCONNECTED, SSEResponse, sse_events, until_disconnect
from pdcluster.entrypoints.openai.structured import EdgeGrammars, requested_grammar
from pdcluster.entrypoints.openai.tool_calls import (
    ToolCallMarkers,
    ToolCallStream,
    markers_for,
    parse_tool_calls,
)

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
        admin_token=topology.autoscale.admin_token,
    )


def build_app(
    backend: ServingBackend,
    api_key: str | None = None,
    slo: SLOConfig | None = None,
    *,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_concurrent_requests: int | None = None,
    admin_token: str | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over `backend` (see the module docstring). State lives on the app.

    Raises ValueError: a limit below 1, or an empty api_key (it would let an empty bearer token in).
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
    # Tokenizing off the event loop, on threads of its own (not the default pool /metrics' stats() uses).
    tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
    app.state.tokenizer_pool = tokenizer_pool

    def encode_off_the_gil(text: str) -> list[int]:
        # `tokenizers`' single `encode` holds the GIL throughout; its batch form releases it.
        return backend.tokenizer.encode_batch([text])[0]

    async def encode(text: str) -> list[int]:
        """`text`'s token ids, tokenized on `tokenizer_pool`.

        Raises ValueError: invalid Unicode. ApiError: 400, untokenized, for a text longer than `max_model_len`
            tokens can hold.
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
    add_admin_routes(app, backend, resolve_admin_token(admin_token))  # dynamic P:D's moves by hand

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if getattr(request.app.state, "starting", False):  # `entrypoints.serve`: listening, not yet serving
            raise ApiError(503, "the server is starting", "service_unavailable")
        try:
            backend.check_ready()  # bookkeeping only: on the event loop, answered at once
        except BackendUnavailable as exc:
            raise ApiError(503, str(exc), "service_unavailable") from exc
        instances = getattr(backend, "health", None)  # a cluster: each instance's state and live ranks
        if instances is None:
            return JSONResponse({"status": "ok"})
        detail = instances()  # bookkeeping only (`InstanceRegistry.health`), no call to a rank
        degraded = any(i.get("degraded") or i.get("state") != "healthy" for i in detail.values())
        return JSONResponse({"status": "degraded" if degraded else "ok", "instances": detail})

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
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
            # a list of prompts: n choices each
            prepared = [await prepare_completion(p, body) for p in body.prompt]
            for each in prepared:
                await with_grammar(each, body)
            start = partial(Generation, backend, metrics=metrics, slo=slo)
            return await serve_prompts(request, prepared, start, body.n)
        prepared = await prepare_completion(body.prompt, body)
        await with_grammar(prepared, body)
        return await serve_one(request, prepared, body, "completion")

    async def prepare_completion(prompt: str | list[int], body: CompletionRequest) -> PreparedRequest:
        prompt_ids = await encode(prompt) if isinstance(prompt, str) else list(prompt)
        echo_text = "" if not body.echo else prompt if isinstance(prompt, str) else None
        if echo_text is None:
            echo_text = backend.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        echo_only = body.echo and body.max_tokens == 0  # score the prompt: one token generated, dropped
        prepared = prepare(
            backend,
            body,
            prompt_ids,
            1 if echo_only else body.max_tokens,
            default_max_tokens=16,
            prefix="cmpl",
            num_top_logprobs=num_top_logprobs(body),
            logit_bias=logit_bias(body),
            echo_text=echo_text,
        )
        prepared.echo_only = echo_only
        if body.echo and body.logprobs is not None:
            prepared.params = dataclasses.replace(prepared.params, prompt_logprobs=body.logprobs)
        return prepared

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
                request, prepared, start, endpoint, body.n, best_of, body.stream, include_usage, tool_markers
            )
        gen = Generation(backend, prepared, metrics, slo)
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
    parser = ToolCallStream(markers)

    def chunk(gen: Generation, text: str, finish: str | None, first: bool) -> dict:
        content, calls = parser.feed(text, final=finish is not None)
        if finish == "stop" and parser.num_calls:
            finish = "tool_calls"
        return response_body(gen, "chat", content, finish, chunk=True, first=first, tool_calls=calls or None)

    return chunk
