"""Calls on the ranks' reply connections (`orchestrator.reply_channel`), the driver's side: a mixin of
`orchestrator.cluster.Cluster` (through `orchestrator.routing.RouteAndReserve`). `_push_call` sends a
reserve or a prefill request to a rank on its connection instead of a Ray call and returns the future of
its answer; `_on_answer_threadsafe` (the listener's `on_answer`) hands each answer, or a connection's close,
to the requests' event loop, where `_on_answer` settles the call it answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from pdcluster.orchestrator.messages import PrefillRequest, ReserveRequest
from pdcluster.orchestrator.reply_channel import ReplyListener, call_soon_on
from pdcluster.orchestrator.reply_records import CALL_KINDS, CallAnswer, RankCall, call_kind


class RankConnectionLost(ConnectionError):
    """A rank's reply connection closed before it answered a call sent on it (the rank died or its
    connection broke): the instance is treated as lost, as after a Ray call to a dead actor."""


class RankCalls:
    """See the module docstring."""

    _reply_listener: ReplyListener | None  # `ClusterWiring`'s
    _call_ids: Iterator[int]  # numbers the calls sent on reply connections
    # call id -> (the rank's tag, the call's record kind, its handoff id, the future of its answer)
    _pending_calls: dict[int, tuple[str, str, str, asyncio.Future]]
    _num_calls_pushed: dict[str, int]  # "reserve" / "prefill": calls sent on a reply connection, not by Ray
    _loop: asyncio.AbstractEventLoop | None  # `RequestDispatch`'s

    def _push_call(
        self, who: str | None, request: ReserveRequest | PrefillRequest, timeout_s: float
    ) -> asyncio.Future | None:
        """Send `request` to the rank whose reply connection has tag `who` (`ReplyListener.send_call`) instead
        of a Ray call; None: no tag or no listener, or the send failed (make the Ray call). The future is the
        answer (`_on_answer`) as the Ray call's would be: the method's result, the error it raised,
        `RankConnectionLost` when the connection closes first, or asyncio.TimeoutError after `timeout_s`."""
        listener = self._reply_listener
        if listener is None or who is None:
            return None
        call = RankCall(next(self._call_ids), request)
        answer = asyncio.get_running_loop().create_future()
        # answered on this thread, after this returns
        self._pending_calls[call.call_id] = (who, call_kind(request), request.handoff_id, answer)
        if not listener.send_call(who, call):
            del self._pending_calls[call.call_id]
            return None
        self._num_calls_pushed[CALL_KINDS[call_kind(request)]] += 1
        answer.add_done_callback(lambda _: self._pending_calls.pop(call.call_id, None))
        return asyncio.ensure_future(asyncio.wait_for(answer, timeout_s))

    def _on_answer_threadsafe(self, who: str, answer: CallAnswer | None) -> None:
        """The reply listener's thread (`ReplyListener`'s `on_answer`): hand a rank's answer to a call, or
        its connection's close (None), to the requests' event loop."""
        call_soon_on(self._loop, self._on_answer, who, answer)

    def _on_answer(self, who: str, answer: CallAnswer | None) -> None:
        """Rank `who` answered a call with its result or the error it raised: taken only for the call of that
        id, kind and handoff, sent to that rank, still waiting (a late answer, whose wait timed out, is
        dropped: as with a Ray call, a reservation it made is released at its lease on the rank). None: the
        rank's connection closed; every call still waiting for it fails as a Ray call to a dead actor
        does."""
        if answer is None:
            rank = who.split(":")[0]  # the rank's name without the incarnation's tag
            for tag, _, _, future in list(self._pending_calls.values()):
                if tag == who and not future.done():
                    future.set_exception(
                        RankConnectionLost(f"{rank}: its connection to the driver closed before it answered")
                    )
            return
        pending = self._pending_calls.get(answer.call_id)
        if pending is None or pending[:3] != (who, answer.kind, answer.handoff_id) or pending[3].done():
            return  # not a call sent to that rank (or not this call's kind and handoff), or given up on
        future = pending[3]
        if isinstance(answer.outcome, BaseException):
            future.set_exception(answer.outcome)
        else:
            future.set_result(answer.outcome)
