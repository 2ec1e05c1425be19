"""`RankClient`: the driver's one way to talk to one rank actor, picked once per deployment
(`driver.wiring.rank_transport`): `RayRankClient` (Ray actor calls), or `SocketRankClient`
(`driver.socket_rank_client`) where every rank runs on the driver's host."""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import secrets
from typing import Any, NamedTuple

from pdcluster.driver.command_order import CommandSeq
from pdcluster.driver.messages import (
    DecodeEvent,
    DecodeNodeLoad,
    PollReply,
    PrefillBind,
    PrefillFirstToken,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    ReserveResult,
)


class PrefillCall(NamedTuple):
    """A prefill's two replies, in order; a prefill failed before its first reply fails both."""

    first: asyncio.Future[PrefillFirstToken]
    result: asyncio.Future[PrefillResult]


class RankClient(abc.ABC):
    """The driver's side of one rank (see the module docstring). Timeouts are seconds; a call that takes
    longer raises asyncio.TimeoutError, one to a dead actor the transport's error."""

    def __init__(self) -> None:
        self.restarted()

    def restarted(self) -> None:
        """The rank runs in a new process: its events number from 1 again; commands start a new stream."""
        self._stream = secrets.token_hex(6)
        self._seq = 0
        self.acked_seq = 0

    def _next_command(self) -> CommandSeq:
        self._seq += 1
        return CommandSeq(self._stream, self._seq)

    def take_in_order(self, polled: list[Any]) -> list[DecodeEvent]:
        """Of `polled` (`PolledEvent`s), the events after the acknowledged one, in sequence, each once."""
        events = []
        for item in polled:
            if item.seq <= self.acked_seq:
                continue
            if item.seq != self.acked_seq + 1:
                break
            self.acked_seq = item.seq
            events.append(item.event)
        return events

    @abc.abstractmethod
    def close(self) -> None:
        """(Any thread) let go of the rank: calls in flight fail."""

    @abc.abstractmethod
    async def reserve(self, request: ReserveRequest, timeout_s: float) -> ReserveResult: ...

    @abc.abstractmethod
    def prefill(self, request: PrefillRequest, timeout_s: float) -> PrefillCall: ...

    @abc.abstractmethod
    def bind(self, bind: PrefillBind) -> None: ...

    @abc.abstractmethod
    def abort(self, handoff_id: str) -> None: ...

    @abc.abstractmethod
    async def load(self, timeout_s: float) -> Any: ...

    @abc.abstractmethod
    async def events(self, wait_s: float, timeout_s: float) -> tuple[list[DecodeEvent], DecodeNodeLoad]: ...


class RayRankClient(RankClient):
    """`RankClient` over Ray actor calls to `actor` (a `PrefillWorker` or `DecodeWorker` handle)."""

    def __init__(self, actor: Any, ordered: bool) -> None:
        self.actor = actor
        self.ordered = ordered
        super().__init__()

    def close(self) -> None:
        """Nothing held: each Ray call stands alone."""

    def _order(self) -> CommandSeq | None:
        return self._next_command() if self.ordered else None

    async def reserve(self, request: ReserveRequest, timeout_s: float) -> ReserveResult:
        return await ray_reply_future(self.actor.reserve.remote(request), timeout_s)

    def prefill(self, request: PrefillRequest, timeout_s: float) -> PrefillCall:
        # two plain calls, not one streamed: a plain reply reaches the event loop in one pass
        first = ray_reply_future(self.actor.prefill_first.remote(request, self._order()), None)
        first.add_done_callback(lambda f: f.cancelled() or f.exception())
        last = ray_reply_future(
            self.actor.prefill_result.remote(request.handoff_id, self._order()), timeout_s
        )
        result = asyncio.ensure_future(_after_first(last, first, timeout_s))
        result.add_done_callback(lambda r: _end_first(first, r))
        return PrefillCall(first, result)

    def bind(self, bind: PrefillBind) -> None:
        with contextlib.suppress(Exception):  # a bind that cannot go shows as its prefill failing
            self.actor.bind.remote(bind, self._order())

    def abort(self, handoff_id: str) -> None:
        with contextlib.suppress(Exception):  # best effort: a dead actor holds nothing
            if self.ordered:
                self.actor.abort.remote(handoff_id, self._order())
            else:
                self.actor.abort.remote(handoff_id)

    async def load(self, timeout_s: float) -> Any:
        return await ray_reply_future(self.actor.load.remote(), timeout_s)

    async def events(self, wait_s: float, timeout_s: float) -> tuple[list[DecodeEvent], DecodeNodeLoad]:
        reply: PollReply = await ray_reply_future(
            self.actor.poll_with_load.remote(wait_s, self.acked_seq), timeout_s
        )
        return self.take_in_order(reply.events), reply.load


def ray_reply_future(ref: Any, timeout_s: float | None) -> asyncio.Future:
    """A future on the running loop for Ray ObjectRef `ref`: its value, the call's exception, or
    asyncio.TimeoutError after `timeout_s` (None: no limit), set from Ray's io thread in one loop pass."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    if timeout_s is not None:
        timer = loop.call_later(timeout_s, lambda: future.done() or future.set_exception(TimeoutError()))
        future.add_done_callback(lambda _: timer.cancel())

    def settle(done: concurrent.futures.Future) -> None:
        if future.done():
            return
        if done.cancelled():
            future.cancel()
        elif done.exception() is not None:
            future.set_exception(done.exception())
        else:
            future.set_result(done.result())

    def on_done(done: concurrent.futures.Future) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, done)

    ref.future().add_done_callback(on_done)
    return future


async def _after_first(last: asyncio.Future, first: asyncio.Future, timeout_s: float) -> PrefillResult:
    """`last`'s value once `first` is done too: the first reply is always taken first. TimeoutError."""
    value = await last
    if not first.done():
        await asyncio.wait({first}, timeout=timeout_s)
        if not first.done():
            raise TimeoutError("the prefill's first reply never came")
    return value


def _end_first(first: asyncio.Future[PrefillFirstToken], result: asyncio.Future[PrefillResult]) -> None:
    """The call ended: a first reply still missing fails (or is cancelled) as the call did."""
    if first.done():
        return
    if result.cancelled():
        first.cancel()
    else:
        first.set_exception(result.exception() or RuntimeError("the prefill call ended without its token"))
