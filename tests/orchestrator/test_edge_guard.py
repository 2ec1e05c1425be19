"""`EdgeGuard` as a bare ASGI middleware, driven by hand (no server, no clock): the admission slot is given
back when the response's last body message is sent, not when the app returns. The app's tail after its
last message (a streaming response's disconnect listener being cancelled, background tasks) used to hold
the slot, so a client that had read the whole response could still be refused 429 (a CI flake of
`test_edge_refuses_beyond_max_concurrent_requests_with_429`)."""

from __future__ import annotations

import asyncio
from typing import Any

from pdcluster.entrypoints.openai.guard import EdgeGuard
from pdcluster.entrypoints.openai.metrics import ApiMetrics

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def test_slot_is_free_when_the_last_body_message_is_sent() -> None:
    seen_in_flight: list[tuple[str, int]] = []
    tail = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        await tail.wait()  # the app's tail: still running after the client has the whole response

    guard = EdgeGuard(
        app, api_key=None, max_request_body_bytes=1024, max_concurrent_requests=1, metrics=ApiMetrics(dict)
    )

    async def receive() -> Any:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        seen_in_flight.append((message["type"], guard.num_in_flight))

    async def main() -> None:
        request = asyncio.ensure_future(guard(SCOPE, receive, send))
        while len(seen_in_flight) < 3:
            await asyncio.sleep(0)
        # the response is complete on the wire while the app is still in its tail: a new request is admitted
        assert not request.done()
        refused: list[tuple[str, int]] = []

        async def other_send(message: Any) -> None:
            refused.append((message["type"], message.get("status", 0)))

        second = asyncio.ensure_future(guard(SCOPE, receive, other_send))
        while not refused:
            await asyncio.sleep(0)
        assert refused[0] == ("http.response.start", 200)
        tail.set()
        await asyncio.gather(request, second)
        assert guard.num_in_flight == 0

    asyncio.run(main())
    assert seen_in_flight == [
        ("http.response.start", 1),
        ("http.response.body", 1),
        ("http.response.body", 0),  # released before the last body message went out
    ]


def test_slot_is_given_back_when_the_app_raises_before_responding() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("backend bug")

    guard = EdgeGuard(
        app, api_key=None, max_request_body_bytes=1024, max_concurrent_requests=1, metrics=ApiMetrics(dict)
    )

    async def receive() -> Any:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        pass

    async def main() -> None:
        try:
            await guard(SCOPE, receive, send)
        except RuntimeError:
            pass
        assert guard.num_in_flight == 0

    asyncio.run(main())
