"""The edge guard: API key, admission (concurrent requests) and body size, checked before a request's body
reaches the app (`EdgeGuard`, a pure ASGI middleware)."""

from __future__ import annotations

import hmac
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from pdcluster.entrypoints.openai.metrics import ApiMetrics
from pdcluster.entrypoints.openai.protocol import RETRY_AFTER_S, error_response

# POSTs to these count against max_concurrent_requests
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
OPEN_PATHS = frozenset({"/health", "/metrics"})  # never behind the API key (probes, scrapers)
_CLOSE = {"Connection": "close"}


@dataclass(eq=False)
class EdgeGuard:
    """Pure ASGI middleware in front of every route. Per HTTP request, in this order, each refusal an
    OpenAI-style error body sent before the app sees the request: 401 without the API key (but on
    `OPEN_PATHS`); 429 with `Retry-After` past `max_concurrent_requests` generation POSTs in flight;
    413 for a body over `max_request_body_bytes` (with `Connection: close`). Event-loop thread only.
    """

    app: Any
    _: KW_ONLY
    api_key: str | None
    max_request_body_bytes: int
    max_concurrent_requests: int | None
    metrics: ApiMetrics
    num_in_flight: int = field(default=0, init=False)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        admin = path.startswith("/admin/")  # its own token (`entrypoints.openai.admin`)
        if self.api_key is not None and path not in OPEN_PATHS and not admin and not self._authorized(scope):
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
        if not counted:
            body_receive = await self._read_body(scope, receive, send)
            if body_receive is not None:
                await self.app(scope, body_receive, send)
            return
        self.num_in_flight += 1
        self.metrics.in_flight.inc()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.num_in_flight -= 1
                self.metrics.in_flight.dec()

        async def send_releasing(message: Any) -> None:
            # The slot is free before the response's last byte is handed to the server, so a client that has
            # read a whole response (a stream's [DONE] included) always finds it free.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()
            await send(message)

        try:
            body_receive = await self._read_body(scope, receive, send_releasing)
            if body_receive is not None:
                await self.app(scope, body_receive, send_releasing)
        finally:
            release()

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
        response = error_response(status, message, type_, None, headers)
        await response(scope, receive, send)
