"""OpenAI-compatible HTTP edge over any `ServingBackend` (`build_app(backend)`).

Endpoints:
    POST /v1/completions        prompt: text or token ids; streaming (SSE) or not
    POST /v1/chat/completions   messages -> one prompt through `CHAT_TEMPLATE_DOC`'s template
    GET  /v1/models             the served model
    GET  /health                200 {"status": "ok"}; 503 when the backend's stats() raises BackendUnavailable
    GET  /metrics               Prometheus text (orchestrator/api_metrics.py lists every metric)

Access and limits (`_EdgeGuard`, checked before a request's body is read; `build_app`'s arguments, from
the YAML's `api` section under `pdcluster deploy`):
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

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON,
a schema violation, text that is not valid Unicode (a lone surrogate such as `"\\ud800"` is valid JSON
but no character: the message names the field, the code point and its index), an unknown model,
unsupported options (n != 1, logprobs, echo, best_of), a bad sampling value, a prompt or prompt +
max_tokens over the context (the message gives the lengths); 401 for a missing or wrong API key; 413 for a
body over the limit; 429 when the edge is full and 503 when the backend raises `BackendUnavailable`
(both retriable, with `Retry-After: RETRY_AFTER_S`). An error after an SSE stream started is sent as a
final `data: {"error": ...}` event, then `data: [DONE]`.

Every response carries `usage` (prompt/completion/total tokens) and a `pdcluster` extension:
    {"request_id", "phases": {queue_s, prefill_s, kv_transfer_s, first_decode_step_s, total_s, ...},
     "ttft_s", "tpot_s", "e2e_s", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
     "acceptance_rate_per_position"}
`phases` are the backend's (seconds); a phase the backend does not report is filled from what the edge saw
(first_decode_step_s: first -> second token delta; total_s: the edge's e2e), `ttft_s`/`tpot_s`/`e2e_s` are
measured at the edge. In a stream it rides on the last chunk (the one with `finish_reason`).

A client that disconnects (before the first byte, mid-stream, or while a non-streaming request runs) has
its request aborted in the backend, which frees its KV blocks and reservations at once.

Run a single-engine server: `python -m orchestrator.api_server --model models/tiny --port 8000`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from engine.sampling_params import SamplingParams
from models.tokenizer import check_unicode
from orchestrator.api_metrics import ApiMetrics
from orchestrator.backend import PHASE_NAMES, BackendUnavailable, ServingBackend, StreamDelta
from orchestrator.topology import (
    CONCURRENT_REQUESTS_PER_DECODE_SEAT,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    SLOConfig,
)

CHAT_TEMPLATE_DOC = """\
Chat template. The bundled tiny model is a Python *code completion* model with no chat training, so the
template is deliberately plain: the messages' contents joined with a blank line ("\\n\\n"), roles dropped,
and the model continues the text of the last message. Put code to complete in the last message."""

MAX_STOP_STRINGS = 16
RETRY_AFTER_S = 1  # the Retry-After header (seconds) of a 429 (edge full) and of a 503 (backend unavailable)
TOKENIZER_THREADS = 2  # worker threads tokenizing prompts (off the event loop), per app
# POSTs to these count against max_concurrent_requests
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
OPEN_PATHS = frozenset({"/health", "/metrics"})  # never behind the API key (probes, scrapers)


# ---- request schemas (pydantic at the edge) -------------------------------------------------------------
def _check_unicode(value: Any) -> Any:
    """Field validator: `value` (a str, or a list whose str items are checked) unchanged when all its text
    is valid Unicode; a lone surrogate raises `models.tokenizer.check_unicode`'s ValueError, which
    pydantic turns into a 400 naming the field (before tokenization)."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str):
            check_unicode(text)
    return value


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str | None = Field(None, description="the served model's id (GET /v1/models); None: that one")
    max_tokens: int | None = Field(
        None, description="output tokens at most; None: 16 (completions) or the rest of the context (chat)"
    )
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="extension: keep the k most likely tokens; 0 or -1 disables")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    ignore_eos: bool = Field(False, description="extension: generate past EOS (benchmarks)")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    _check_stop = field_validator("stop")(_check_unicode)


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(..., description="text, or token ids of the served model's tokenizer")
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    _check_prompt = field_validator("prompt")(_check_unicode)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str

    _check_content = field_validator("content")(_check_unicode)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The prompt text of a chat request (see `CHAT_TEMPLATE_DOC`)."""
    return "\n\n".join(m.content for m in messages)


# ---- errors -----------------------------------------------------------------------------------------------
class ApiError(Exception):
    """Answered as an OpenAI-style error body with `status_code`."""

    def __init__(
        self, status_code: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type_
        self.param = param


def _error_body(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(exc: ApiError) -> JSONResponse:
    """The error body; 429 and 503 (worth retrying) carry `Retry-After: RETRY_AFTER_S`."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status_code in (429, 503) else None
    return JSONResponse(
        _error_body(exc.message, exc.type, exc.param, exc.status_code), exc.status_code, headers=headers
    )


# ---- one request at the edge -----------------------------------------------------------------------------
@dataclass
class _Prepared:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str
    created_s: int


@dataclass
class _Progress:
    """What the edge has seen of one request so far."""

    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_s: float | None = None
    second_delta_s: float | None = None
    last_token_s: float | None = None
    last: StreamDelta | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could be the start of a stop string (held back in a stream)."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class _Generation:
    """Drives one backend request: stop strings (when the backend gives no text), timings, metrics, abort."""

    def __init__(
        self,
        backend: ServingBackend,
        prepared: _Prepared,
        metrics: ApiMetrics,
        slo: SLOConfig | None,
    ) -> None:
        self.backend = backend
        self.prepared = prepared
        self.metrics = metrics
        self.slo = slo
        self.progress = _Progress(arrival_s=time.perf_counter())
        self._deltas = backend.generate(prepared.request_id, prepared.prompt_token_ids, prepared.params)
        self._closed = False

    async def next(self) -> StreamDelta | None:
        """The next delta (already folded into `progress`), or None after the last one."""
        if self.progress.finished:
            return None
        try:
            delta = await anext(self._deltas)
        except StopAsyncIteration:
            # a backend that ends its stream without a finished delta: treat as aborted
            self.progress.finish_reason = "abort"
            return None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        except BackendUnavailable as exc:
            raise ApiError(503, str(exc), "service_unavailable") from exc
        self._fold(delta)
        return delta

    def _fold(self, delta: StreamDelta) -> None:
        p, now = self.progress, time.perf_counter()
        if delta.new_token_ids:
            if p.first_token_s is None:
                p.first_token_s = now
            else:
                if p.second_delta_s is None:
                    p.second_delta_s = now
                self.metrics.itl_s.observe(now - p.last_token_s)
            p.last_token_s = now
            p.token_ids.extend(delta.new_token_ids)
        p.last = delta
        if delta.text is not None:
            p.text = delta.text
        else:  # the backend gives tokens only: detokenize and look for stop strings here
            p.text = self.backend.tokenizer.decode(p.token_ids)
            stops = self.prepared.params.stop
            hits = [p.text.find(s) for s in stops if s in p.text]
            if hits:
                p.text = p.text[: min(hits)]
                p.finish_reason = "stop"  # close() aborts the backend request if it is still running
                return
        if delta.finished:
            p.finish_reason = delta.finish_reason or "stop"

    def stream_text(self, num_sent_chars: int) -> str:
        """New text to send: held back while it ends in an incomplete character or a possible stop prefix."""
        p = self.progress
        text = p.text
        if not p.finished:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - _stop_prefix_len(text, self.prepared.params.stop)]
        return text[num_sent_chars:]

    async def close(self) -> None:
        """Finish the bookkeeping; abort the backend request if it did not finish. Idempotent."""
        if self._closed:
            return
        self._closed = True
        p = self.progress
        if p.last is None or not p.last.finished:
            # the client went away, an error, or a stop string found here: the backend must let go
            with contextlib.suppress(Exception):
                await self._deltas.aclose()
            with contextlib.suppress(Exception):
                await self.backend.abort(self.prepared.request_id)
        else:
            with contextlib.suppress(Exception):
                await self._deltas.aclose()
        self._record()

    def _record(self) -> None:
        m, p = self.metrics, self.progress
        reason = p.finish_reason or "abort"
        m.requests.labels(reason).inc()
        if reason == "abort":
            return
        m.prompt_tokens.inc(len(self.prepared.prompt_token_ids))
        m.generation_tokens.inc(len(p.token_ids))
        ext = self.extension()
        if ext["ttft_s"] is not None:
            m.ttft_s.observe(ext["ttft_s"])
        if ext["tpot_s"] is not None:
            m.tpot_s.observe(ext["tpot_s"])
        m.e2e_s.observe(ext["e2e_s"])
        for name, value in ext["phases"].items():
            if name.endswith("_s"):
                m.phase_s.labels(name.removesuffix("_s")).observe(value)
        if "kv_transfer_s" in ext["phases"]:
            m.kv_transfer_s.observe(ext["phases"]["kv_transfer_s"])
        if "kv_transfer_bytes" in ext["phases"]:
            m.kv_transfer_bytes.inc(ext["phases"]["kv_transfer_bytes"])
        last = p.last
        if last is not None:
            for i, n in enumerate(last.num_draft_tokens_per_position):
                m.num_draft_tokens.labels(str(i)).inc(n)
            for i, n in enumerate(last.num_accepted_tokens_per_position):
                m.num_accepted_tokens.labels(str(i)).inc(n)
        if self.slo is not None and (self.slo.ttft_ms is not None or self.slo.tpot_ms is not None):
            m.slo_requests.labels(str(meets_slo(ext["ttft_s"], ext["tpot_s"], self.slo)).lower()).inc()

    # ---- response pieces -----------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        num_prompt = len(self.prepared.prompt_token_ids)
        num_completion = len(self.progress.token_ids)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
        }

    def extension(self) -> dict[str, Any]:
        p = self.progress
        end_s = p.last_token_s if p.last_token_s is not None else time.perf_counter()
        ttft_s = None if p.first_token_s is None else p.first_token_s - p.arrival_s
        num_tokens = len(p.token_ids)
        tpot_s = None
        if num_tokens > 1 and p.first_token_s is not None:
            tpot_s = (p.last_token_s - p.first_token_s) / (num_tokens - 1)
        e2e_s = end_s - p.arrival_s
        last = p.last or StreamDelta([])
        phases = last.reported_phases()
        if "first_decode_step_s" not in phases and p.second_delta_s is not None:
            phases["first_decode_step_s"] = p.second_delta_s - p.first_token_s
        phases.setdefault("total_s", e2e_s)
        per_position = [
            a / d if d else None
            for a, d in zip(
                last.num_accepted_tokens_per_position, last.num_draft_tokens_per_position, strict=False
            )
        ]
        return {
            "request_id": self.prepared.request_id,
            "phases": {
                k: phases[k] for k in (*PHASE_NAMES, *sorted(set(phases) - set(PHASE_NAMES))) if k in phases
            },
            "ttft_s": ttft_s,
            "tpot_s": tpot_s,
            "e2e_s": e2e_s,
            "num_draft_tokens": last.num_draft_tokens,
            "num_accepted_tokens": last.num_accepted_tokens,
            "acceptance_rate": last.acceptance_rate,
            "acceptance_rate_per_position": per_position,
        }


def meets_slo(ttft_s: float | None, tpot_s: float | None, slo: SLOConfig) -> bool:
    """Both SLOs met (an unset target always is; a request with one output token has no TPOT to miss)."""
    if slo.ttft_ms is not None and (ttft_s is None or ttft_s * 1000 > slo.ttft_ms):
        return False
    return not (slo.tpot_ms is not None and tpot_s is not None and tpot_s * 1000 > slo.tpot_ms)


# ---- the edge guard: API key, admission, body size --------------------------------------------------------
class _EdgeGuard:
    """Pure ASGI middleware in front of every route. Per HTTP request, in this order, each refusal an
    OpenAI-style error body sent before the app sees the request:

    1. API key (when one is set): every path but `OPEN_PATHS` (/health, /metrics) needs
       `Authorization: Bearer <key>`, the docs included (/docs, /redoc, /openapi.json): else 401, the body
       unread.
    2. Admission: a POST to `GENERATION_PATHS` while `max_concurrent_requests` of them are in flight
       (admitted here and their response not ended, a stream's last byte included): 429 with
       `Retry-After: RETRY_AFTER_S`, the body unread. A streamed request is refused with a status, never
       with an error inside a 200 stream. None: no limit.
    3. Body size: a `Content-Length` over `max_request_body_bytes`: 413 at once, nothing read; otherwise
       the body is read here and refused with 413 as soon as more than the limit has arrived (a chunked
       body), then handed to the app. A 413 carries `Connection: close`, so the rest is not read.

    The counters live on the event loop's thread only (no lock).
    """

    def __init__(
        self,
        app: Any,
        *,
        api_key: str | None,
        max_request_body_bytes: int,
        max_concurrent_requests: int | None,
        metrics: ApiMetrics,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_request_body_bytes = max_request_body_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.metrics = metrics
        self.num_in_flight = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            await self._refuse(
                scope,
                receive,
                send,
                401,
                "invalid or missing API key (send Authorization: Bearer <key>)",
                "authentication_error",
            )
            return
        counted = scope["method"] == "POST" and path in GENERATION_PATHS
        limit = self.max_concurrent_requests
        if counted and limit is not None and self.num_in_flight >= limit:
            await self._refuse(
                scope,
                receive,
                send,
                429,
                f"the server is at its limit of {limit} concurrent requests; retry after {RETRY_AFTER_S} s",
                "rate_limit_exceeded",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
            return
        if counted:
            self.num_in_flight += 1
            self.metrics.in_flight.inc()
        try:
            body_receive = await self._read_body(scope, receive, send)
            if body_receive is not None:
                await self.app(scope, body_receive, send)
        finally:
            if counted:
                self.num_in_flight -= 1
                self.metrics.in_flight.dec()

    def _authorized(self, scope: Any) -> bool:
        assert self.api_key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self.api_key.encode()
                )
        return False

    async def _read_body(self, scope: Any, receive: Any, send: Any) -> Any:
        """The whole body read (at most `max_request_body_bytes`), as a `receive` for the app that gives it
        first, then what the server sends (a disconnect); None: refused with 413, or the client left."""
        limit = self.max_request_body_bytes
        too_large = (
            f"the request body is over this server's limit of {limit} bytes (api.max_request_body_bytes)"
        )
        for name, value in scope["headers"]:
            if name == b"content-length" and value.strip().isdigit() and int(value) > limit:
                await self._refuse(scope, receive, send, 413, too_large, "invalid_request_error", _CLOSE)
                return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(scope, receive, send, 413, too_large, "invalid_request_error", _CLOSE)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        first: dict[str, Any] | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def body_receive() -> Any:
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            return await receive()

        return body_receive

    async def _refuse(
        self,
        scope: Any,
        receive: Any,
        send: Any,
        status: int,
        message: str,
        type_: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.metrics.errors.labels(str(status)).inc()
        response = JSONResponse(_error_body(message, type_, None, status), status, headers=headers)
        await response(scope, receive, send)


_CLOSE = {"Connection": "close"}


# ---- the app --------------------------------------------------------------------------------------------
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
        max_request_body_bytes: a larger request body is answered 413, unread (`_EdgeGuard`).
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
        _EdgeGuard,
        api_key=api_key,
        max_request_body_bytes=max_request_body_bytes,
        max_concurrent_requests=max_concurrent_requests,
        metrics=metrics,
    )
    # Tokenizing a long prompt takes seconds: done here, the event loop (/health, every stream) goes on.
    # Its own threads, so a queue of long prompts does not hold up /health's stats() in the default pool.
    tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
    app.state.tokenizer_pool = tokenizer_pool

    def encode_off_the_gil(text: str) -> list[int]:
        # `tokenizers`' single `encode` holds the GIL throughout (seconds for a few MB: the event loop
        # would stall even on another thread); its batch form releases it while the Rust code runs.
        return backend.tokenizer.encode_batch([text])[0]

    async def encode(text: str) -> list[int]:
        """`text`'s token ids, tokenized on `tokenizer_pool`. Raises ValueError for invalid Unicode."""
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, encode_off_the_gil, text)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.errors.labels(str(exc.status_code)).inc()
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            message = "the request body is not valid JSON"
            param = None
        else:
            parts = []
            for e in errors:
                loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
            message = "invalid request: " + "; ".join(parts)
            param = ".".join(str(x) for x in errors[0].get("loc", ()) if x != "body") if errors else None
        metrics.errors.labels("400").inc()
        return JSONResponse(_error_body(message, "invalid_request_error", param or None, 400), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            _error_body(str(exc.detail), "invalid_request_error", None, exc.status_code), exc.status_code
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        metrics.errors.labels("500").inc()
        message = f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse(_error_body(message, "internal_error", None, 500), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            await asyncio.to_thread(backend.stats)  # the cluster's may wait for a call timeout
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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _reject_unsupported(body)
        if body.logprobs is not None:
            raise ApiError(400, "logprobs is not supported by this server", param="logprobs")
        if body.echo:
            raise ApiError(400, "echo is not supported by this server", param="echo")
        if body.best_of not in (None, 1):
            raise ApiError(
                400, f"best_of must be 1 (got {body.best_of}): one completion per request", param="best_of"
            )
        if isinstance(body.prompt, str):
            prompt_ids = await encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        prepared = _prepare(backend, body, prompt_ids, body.max_tokens, default_max_tokens=16, prefix="cmpl")
        return await _serve(request, prepared, body.stream, _completion_chunk, _completion_response)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _reject_unsupported(body)
        if body.logprobs or body.top_logprobs is not None:
            raise ApiError(400, "logprobs is not supported by this server", param="logprobs")
        prompt_ids = await encode(chat_prompt(body.messages))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prepared = _prepare(backend, body, prompt_ids, max_tokens, default_max_tokens=None, prefix="chatcmpl")
        return await _serve(request, prepared, body.stream, _chat_chunk, _chat_response)

    async def _serve(
        request: Request,
        prepared: _Prepared,
        stream: bool,
        chunk: Callable[[_Generation, str, str | None, bool], dict[str, Any]],
        whole: Callable[[_Generation], dict[str, Any]],
    ) -> Response:
        gen = _Generation(backend, prepared, metrics, slo)
        # Wait for the first delta before answering, so a request the backend refuses gets a real 400/503
        # instead of an error event inside a 200 stream.
        try:
            first = await _until_disconnect(request, gen.next())
        except BaseException:
            await gen.close()
            raise
        if first is _DISCONNECTED:
            await gen.close()
            return Response(status_code=499)
        if stream:
            return _SSEResponse(_sse_events(gen, chunk), on_close=gen.close)
        try:
            result = await _until_disconnect(request, _drain(gen))
        finally:
            await gen.close()
        if result is _DISCONNECTED:
            return Response(status_code=499)
        return JSONResponse(whole(gen))

    return app


def _reject_unsupported(body: _Common) -> None:
    if body.n != 1:
        raise ApiError(
            400, f"n must be 1 (got {body.n}): this server returns one choice per request", param="n"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise ApiError(400, f"{name} is not supported by this server (must be 0)", param=name)


def _prepare(
    backend: ServingBackend,
    body: _Common,
    prompt_ids: list[int],
    max_tokens: int | None,
    default_max_tokens: int | None,
    prefix: str,
) -> _Prepared:
    if body.model is not None and body.model != backend.model_name:
        raise ApiError(
            400, f"unknown model {body.model!r}; this server serves {backend.model_name!r}", param="model"
        )
    num_prompt = len(prompt_ids)
    max_len = backend.max_model_len
    if num_prompt == 0:
        raise ApiError(400, "the prompt is empty (0 tokens)", param="prompt")
    vocab_size = getattr(backend, "vocab_size", None) or backend.tokenizer.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", param="prompt")
    if num_prompt >= max_len:
        raise ApiError(
            400,
            f"the prompt has {num_prompt} tokens, but the model's context (max_model_len) is {max_len} "
            "tokens "
            "and at least one must be left for the output",
            param="prompt",
        )
    if max_tokens is None:
        max_tokens = (
            max_len - num_prompt
            if default_max_tokens is None
            else min(default_max_tokens, max_len - num_prompt)
        )
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if num_prompt + max_tokens > max_len:
        raise ApiError(
            400,
            f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is {num_prompt + max_tokens} "
            f"tokens, over the model's context (max_model_len) of {max_len} tokens",
            param="max_tokens",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    try:
        params = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=body.ignore_eos,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    return _Prepared(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        params=params,
        model=backend.model_name,
        created_s=int(time.time()),
    )


# ---- streaming and disconnects --------------------------------------------------------------------------
_DISCONNECTED = object()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`await work`, or `_DISCONNECTED` (work cancelled) if the client goes away first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        watch_task.cancel()
        await asyncio.gather(watch_task, return_exceptions=True)
    if work_task.cancelled() or not work_task.done():
        await asyncio.gather(work_task, return_exceptions=True)
        return _DISCONNECTED
    return work_task.result()


async def _drain(gen: _Generation) -> None:
    while await gen.next() is not None:
        pass


def _sse(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _sse_events(
    gen: _Generation, chunk: Callable[[_Generation, str, str | None, bool], dict[str, Any]]
) -> AsyncIterator[bytes]:
    num_sent_chars = 0
    first = True
    try:
        while True:
            text = gen.stream_text(num_sent_chars)
            num_sent_chars += len(text)
            finish = gen.progress.finish_reason
            if text or first or finish is not None:
                yield _sse(chunk(gen, text, finish, first))
                first = False
            if finish is not None:
                break
            await gen.next()
    except ApiError as exc:
        gen.metrics.errors.labels(str(exc.status_code)).inc()
        yield _sse(_error_body(exc.message, exc.type, exc.param, exc.status_code))
    yield _sse("[DONE]")


class _SSEResponse(StreamingResponse):
    """An SSE stream that watches for the client going away (whatever the ASGI spec version) and always runs
    `on_close` (which aborts an unfinished request) when the response ends."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stream_task = asyncio.ensure_future(self.stream_response(send))
        watch_task = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream_task, watch_task):
                task.cancel()
            await asyncio.gather(stream_task, watch_task, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close()


# ---- response bodies ------------------------------------------------------------------------------------
def _completion_chunk(gen: _Generation, text: str, finish: str | None, first: bool) -> dict[str, Any]:
    body = {
        "id": gen.prepared.request_id,
        "object": "text_completion",
        "created": gen.prepared.created_s,
        "model": gen.prepared.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if finish is not None:
        body["usage"] = gen.usage()
        body["pdcluster"] = gen.extension()
    return body


def _completion_response(gen: _Generation) -> dict[str, Any]:
    return {
        "id": gen.prepared.request_id,
        "object": "text_completion",
        "created": gen.prepared.created_s,
        "model": gen.prepared.model,
        "choices": [
            {
                "index": 0,
                "text": gen.progress.text,
                "logprobs": None,
                "finish_reason": gen.progress.finish_reason,
            }
        ],
        "usage": gen.usage(),
        "pdcluster": gen.extension(),
    }


def _chat_chunk(gen: _Generation, text: str, finish: str | None, first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    body = {
        "id": gen.prepared.request_id,
        "object": "chat.completion.chunk",
        "created": gen.prepared.created_s,
        "model": gen.prepared.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if finish is not None:
        body["usage"] = gen.usage()
        body["pdcluster"] = gen.extension()
    return body


def _chat_response(gen: _Generation) -> dict[str, Any]:
    return {
        "id": gen.prepared.request_id,
        "object": "chat.completion",
        "created": gen.prepared.created_s,
        "model": gen.prepared.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": gen.progress.text},
                "logprobs": None,
                "finish_reason": gen.progress.finish_reason,
            }
        ],
        "usage": gen.usage(),
        "pdcluster": gen.extension(),
    }


# ---- running a server -----------------------------------------------------------------------------------
class ServerThread:
    """uvicorn serving `app` on `host` (a free port with port=0) in a background thread; `stop()` ends it.

    Used by the tests and `pdcluster bench --serve-local`; binds 127.0.0.1 unless told otherwise.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="pdcluster-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m orchestrator.api_server`: one LocalEngineBackend behind the API (foreground)."""
    import uvicorn

    from engine.config import EngineConfig
    from models import bundled_checkpoint_dir
    from orchestrator.backend import LocalEngineBackend

    parser = argparse.ArgumentParser(prog="python -m orchestrator.api_server", description=main.__doc__)
    parser.add_argument("--model", default=str(bundled_checkpoint_dir()))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument("--ttft-slo-ms", type=float, default=None)
    parser.add_argument("--tpot-slo-ms", type=float, default=None)
    parser.add_argument(
        "--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES, help="larger: 413"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help=f"beyond it 429 (default: {CONCURRENT_REQUESTS_PER_DECODE_SEAT} x the engine's max_num_seqs)",
    )
    args = parser.parse_args(argv)
    backend = LocalEngineBackend(
        EngineConfig(
            model=args.model,
            max_model_len=args.max_model_len,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    )
    slo = SLOConfig(ttft_ms=args.ttft_slo_ms, tpot_ms=args.tpot_slo_ms)
    max_concurrent = args.max_concurrent_requests
    if max_concurrent is None:
        max_concurrent = CONCURRENT_REQUESTS_PER_DECODE_SEAT * backend.engine.config.max_num_seqs
    app = build_app(
        backend,
        api_key=args.api_key,
        slo=slo,
        max_request_body_bytes=args.max_request_body_bytes,
        max_concurrent_requests=max_concurrent,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        backend.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
