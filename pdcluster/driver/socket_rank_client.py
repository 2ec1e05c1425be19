"""`SocketRankClient`: the `RankClient` of a rank on the driver's host, over one Unix socket.

Every call of the interface goes over the rank's channel (`workers.rank_channel`); Ray only tells the client
where the channel is (`serve_driver_channel`, at the first connection and after a broken one). The socket is
read on the requests' event loop (asyncio). Inside the client: call ids, the prefill command stream's
order, the event sequence numbers and their acknowledgements, reconnecting (a new command stream each
time; the events after the last acknowledged one come again), and a new rank process (events from 1).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from pdcluster.driver import rank_wire as wire
from pdcluster.driver.messages import (
    DecodeEvent,
    DecodeNodeLoad,
    PrefillBind,
    PrefillFirstToken,
    PrefillNodeLoad,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    ReserveResult,
)
from pdcluster.driver.rank_client import PrefillCall, RankClient, ray_reply_future
from pdcluster.kvtransfer.base import ProtocolError

logger = logging.getLogger(__name__)

ACK_INTERVAL_S = 0.05  # taken events are acknowledged to the rank at most this often
CONNECT_TIMEOUT_S = 10.0  # finding (over Ray), connecting to and greeting a rank's channel


class _Call:
    """A call waiting for its replies: `futures` in reply order, each decoded as its `kinds` entry."""

    def __init__(self, futures: list[asyncio.Future], kinds: list[type]) -> None:
        self.futures, self.kinds = futures, kinds

    def take(self, record: Any) -> bool:
        """Settle the next future from `record`; whether the call is over."""
        future, kind = self.futures.pop(0), self.kinds.pop(0)
        if isinstance(record, wire.Failed):
            self.fail(wire.remote_error(record), future)
            return True
        try:
            value = wire.decode_as(record.value, kind)
        except ProtocolError as e:
            self.fail(e, future)
            return True
        if not future.done():
            future.set_result(value)
        return not self.futures

    def fail(self, error: BaseException, first: asyncio.Future | None = None) -> None:
        for future in ([first] if first is not None else []) + self.futures:
            if not future.done():
                future.set_exception(error)
        self.futures, self.kinds = [], []


class _Protocol(asyncio.Protocol):
    def __init__(self, client: SocketRankClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.welcome: asyncio.Future = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            while len(self._buffer) >= wire.LENGTH.size:
                length = wire.frame_length(bytes(self._buffer[: wire.LENGTH.size]))
                end = wire.LENGTH.size + length
                if len(self._buffer) < end:
                    return
                body = bytes(self._buffer[wire.LENGTH.size : end])
                del self._buffer[:end]
                self.client._take(self, wire.decode_to_driver(body))
        except ProtocolError as e:
            logger.error("%s: closing its channel: %s", self.client.name, e)
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.welcome.done():
            self.welcome.set_exception(wire.RankConnectionLost("closed before its welcome"))
        self.client._lost(self, exc)


class SocketRankClient(RankClient):
    """`RankClient` of rank actor `actor` (role "prefill" | "decode") over its channel. `address`: where the
    channel is, when known (else asked of the actor over Ray)."""

    def __init__(self, actor: Any, role: str, name: str = "", address: wire.ChannelAddress | None = None):
        self.actor, self.role, self.name = actor, role, name or role
        self.ordered = role == "prefill"
        self._address = address
        self._link: _Protocol | None = None
        self._linking: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: list[Callable[[], Any]] = []  # records to write once linked, in order
        self._calls: dict[int, _Call] = {}
        self._next_call = 0
        self._pushes: collections.deque = collections.deque()  # `Events` pushed, or the error that ended them
        self._pushed = asyncio.Event()
        self._subscribed = False
        self._incarnation: str | None = None
        self._acked_sent = 0
        self._acked_at_s = 0.0
        super().__init__()
        self._stale = False

    def restarted(self) -> None:
        super().restarted()
        self._stale = True  # (any thread) the next use drops the link and asks Ray where the channel is

    def close(self) -> None:
        """(Any thread) close the link; calls in flight fail with RankConnectionLost."""
        link, loop = self._link, self._loop
        if link is not None and link.transport is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: so did its sockets' use
                loop.call_soon_threadsafe(link.transport.close)

    # ---- the interface -----------------------------------------------------------------------------------
    async def reserve(self, request: ReserveRequest, timeout_s: float) -> ReserveResult:
        (future,) = self._send_call(lambda call: wire.Reserve(call, request), [ReserveResult])
        return await asyncio.wait_for(future, timeout_s)

    def prefill(self, request: PrefillRequest, timeout_s: float) -> PrefillCall:
        def record(call: int) -> wire.Prefill:
            return wire.Prefill(call, request, self._next_command())

        first, result = self._send_call(record, [PrefillFirstToken, PrefillResult])
        loop = asyncio.get_running_loop()
        timer = loop.call_later(
            timeout_s,
            lambda: result.done() or result.set_exception(TimeoutError("no prefill result in time")),
        )
        result.add_done_callback(lambda _: timer.cancel())
        result.add_done_callback(lambda r: first.done() or _fail_like(first, r))
        first.add_done_callback(lambda f: f.cancelled() or f.exception())
        return PrefillCall(first, result)

    def bind(self, bind: PrefillBind) -> None:
        self._send(lambda: wire.Bind(bind, self._next_command()))

    def abort(self, handoff_id: str) -> None:
        self._send(lambda: wire.Abort(handoff_id, self._next_command() if self.ordered else None))

    async def load(self, timeout_s: float) -> Any:
        kind = PrefillNodeLoad if self.ordered else DecodeNodeLoad
        (future,) = self._send_call(lambda call: wire.Load(call), [kind])
        return await asyncio.wait_for(future, timeout_s)

    async def events(self, wait_s: float, timeout_s: float) -> tuple[list[DecodeEvent], DecodeNodeLoad]:
        """The events pushed since the last call, in order, and the latest load; waits up to `timeout_s`
        for a push (the rank pushes its load at least every `workers.rank_channel.PUSH_IDLE_S`)."""
        self._ensure_link()
        if not self._subscribed:
            self._subscribed = True
            self._send(lambda: wire.Subscribe(self.acked_seq))
        pushes, pushed = self._pushes, self._pushed
        if not pushes:
            pushed.clear()
            await asyncio.wait_for(pushed.wait(), timeout_s)
        if isinstance(pushes[0], BaseException):
            raise pushes.popleft()
        events: list[DecodeEvent] = []
        while pushes and not isinstance(pushes[0], BaseException):  # (an error waits for the next call)
            push = pushes.popleft()
            events += self.take_in_order(wire.polled(push))
            load = push.load
        now_s = time.monotonic()
        if self.acked_seq > self._acked_sent and now_s - self._acked_at_s >= ACK_INTERVAL_S:
            self._acked_sent, self._acked_at_s = self.acked_seq, now_s
            self._send(lambda: wire.Ack(self.acked_seq))
        return events, load

    # ---- sending -----------------------------------------------------------------------------------------
    def _send_call(self, record: Callable[[int], Any], kinds: list[type]) -> list[asyncio.Future]:
        self._ensure_link()
        assert self._loop is not None
        futures = [self._loop.create_future() for _ in kinds]
        self._next_call += 1
        call = self._next_call
        self._calls[call] = _Call(list(futures), kinds)
        futures[-1].add_done_callback(lambda _: self._calls.pop(call, None))
        self._send(lambda: record(call))
        return futures

    def _send(self, record: Callable[[], Any]) -> None:
        """Write the record `record()` makes now if linked, else once linked (in order either way)."""
        self._ensure_link()
        link = self._link
        if link is not None and link.welcome.done() and not self._outbox:
            assert link.transport is not None
            link.transport.write(wire.frame(record()))
        else:
            self._outbox.append(record)

    # ---- the link ----------------------------------------------------------------------------------------
    def _ensure_link(self) -> None:
        """On the running loop: a link that is up or being made (a new one after a loss, a restart or on
        another loop)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._stale:
            if self._stale:
                self._address, self._stale = None, False
            if self._link is not None and self._link.transport is not None:
                with contextlib.suppress(RuntimeError):
                    self._link.transport.close()
            self._drop_link(wire.RankConnectionLost(f"{self.name}: its channel was replaced"))
            self._loop, self._pushes, self._pushed = loop, collections.deque(), asyncio.Event()
        if self._link is None and self._linking is None:
            self._linking = loop.create_task(self._connect())

    async def _connect(self) -> None:
        me = asyncio.current_task()
        try:
            link = await asyncio.wait_for(self._open(), CONNECT_TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - every call waiting on this link fails as on a dead actor
            if self._linking is me:  # (else dropped meanwhile: a newer link owns the state)
                self._linking = None
                error = e if isinstance(e, wire.RankConnectionLost | TimeoutError) else None
                self._fail_waiting(error or wire.RankConnectionLost(f"{self.name}: no channel: {e!r}"))
                self._outbox.clear()
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        if self._linking is not me:
            assert link.transport is not None
            link.transport.close()
            return
        self._linking, self._link = None, link
        self._stream_restarted()
        assert link.transport is not None
        while self._outbox:
            link.transport.write(wire.frame(self._outbox.pop(0)()))

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            if self._address is None:
                self._address = await ray_reply_future(
                    self.actor.serve_driver_channel.remote(), CONNECT_TIMEOUT_S
                )
            try:
                _, link = await loop.create_unix_connection(lambda: _Protocol(self), self._address.path)
            except OSError:
                if attempt:
                    raise
                self._address = None  # an old process's channel: ask where the rank's is now
                continue
            link.transport.write(wire.frame(wire.Hello(self._address.secret)))
            welcome = await link.welcome
            if self._incarnation is not None and welcome.incarnation != self._incarnation:
                RankClient.restarted(self)  # a new process: its events number from 1
                self._acked_sent = 0
            self._incarnation = welcome.incarnation
            return link
        raise AssertionError("unreachable")

    def _stream_restarted(self) -> None:
        """A new link starts a new command stream (commands lost with the old one leave no gap)."""
        acked_seq = self.acked_seq
        RankClient.restarted(self)
        self.acked_seq = acked_seq

    def _take(self, link: _Protocol, record: Any) -> None:
        if isinstance(record, wire.Welcome):
            if not link.welcome.done():
                link.welcome.set_result(record)
        elif isinstance(record, wire.Events):
            if link is self._link:
                self._pushes.append(record)
                self._pushed.set()
        elif isinstance(record, wire.Reply | wire.Failed):
            call = self._calls.get(record.call)
            if call is not None and link is self._link and call.take(record):
                self._calls.pop(record.call, None)

    def _lost(self, link: _Protocol, exc: Exception | None) -> None:
        if link is self._link:
            why = f": {exc!r}" if exc is not None else ""
            self._drop_link(wire.RankConnectionLost(f"{self.name}: its channel closed{why}"))

    def _drop_link(self, error: BaseException) -> None:
        self._link = None
        if self._linking is not None:
            with contextlib.suppress(RuntimeError):  # a task of a loop that closed
                self._linking.cancel()
            self._linking = None
        self._outbox.clear()
        self._fail_waiting(error)

    def _fail_waiting(self, error: BaseException) -> None:
        """Fail every call in flight and a wait for events with `error`."""
        calls, self._calls = self._calls, {}
        with contextlib.suppress(RuntimeError):  # futures of a loop that closed
            for call in calls.values():
                call.fail(error)
            if self._subscribed:
                self._pushes.append(error)
                self._pushed.set()
        self._subscribed = False


def _fail_like(first: asyncio.Future, result: asyncio.Future) -> None:
    """The prefill call ended without its first reply: it fails (or is cancelled) as the call did."""
    if result.cancelled():
        first.cancel()
    else:
        first.set_exception(result.exception() or RuntimeError("the prefill call ended without its token"))
