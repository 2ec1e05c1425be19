"""Server-sent events and client disconnects: the SSE framing, the event stream of one `Generation`, an
SSE response that aborts its request when it ends, and `until_disconnect` for the non-streaming path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from pdcluster.entrypoints.openai.generation import Generation
from pdcluster.entrypoints.openai.protocol import ApiError

# what `until_disconnect` returns when the client went away first
DISCONNECTED = object()

# builds one chunk: (generation, new text, finish_reason or None, first chunk?) -> JSON body
ChunkBuilder = Callable[[Generation, str, "str | None", bool], dict[str, Any]]
# builds the usage-only chunk of `stream_options.include_usage`: (generation) -> JSON body
UsageChunkBuilder = Callable[[Generation], dict[str, Any]]


def sse_event(payload: Any) -> bytes:
    """One SSE event: `data: <payload>\\n\\n`, a str as it is, anything else as compact JSON (UTF-8)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def sse_events(
    gen: Generation, chunk: ChunkBuilder, usage_chunk: UsageChunkBuilder | None = None
) -> AsyncIterator[bytes]:
    """The SSE events of `gen`: one chunk per delta with new text, the last with its finish reason, an
    optional `usage` chunk (`usage_chunk`), then `[DONE]`."""
    num_sent_chars = 0
    first = True
    try:
        while True:
            text = gen.stream_text(num_sent_chars)
            num_sent_chars += len(text)
            finish = gen.progress.finish_reason
            if text or first or finish is not None:
                yield sse_event(chunk(gen, text, finish, first))
                first = False
            if finish is not None:
                break
            await gen.next()
        if usage_chunk is not None:
            yield sse_event(usage_chunk(gen))
    except ApiError as exc:
        gen.metrics.errors.labels(str(exc.status_code)).inc()
        yield sse_event(exc.body())
    yield sse_event("[DONE]")


class SSEResponse(StreamingResponse):
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


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`await work`, or `DISCONNECTED` (work cancelled) if the client goes away first."""
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
        return DISCONNECTED
    return work_task.result()
