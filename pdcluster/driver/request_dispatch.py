"""A `Cluster`'s request path: route, reserve, prefill, stream decode's tokens, over `driver.dispatch`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Mapping

from pdcluster.config import Topology
from pdcluster.driver import elastic_requests as elastic_attempts
from pdcluster.driver.actor_errors import describe_error
from pdcluster.driver.backend import BackendUnavailable, StreamDelta
from pdcluster.driver.dispatch import (
    MAX_DISPATCH_ATTEMPTS,
    POLL_WAIT_S,
    AttemptState,
    Emit,
    EndAborted,
    Event,
    Fail,
    NoEvent,
    PrefillDone,
    Prefilled,
    PrefillSampled,
    Redispatch,
    Wait,
    next_action,
)
from pdcluster.driver.elastic import elastic_ep
from pdcluster.driver.elastic_requests import held, kept, shrink_bound_s, wait_first
from pdcluster.driver.handoff import HandoffEvent, decode_has_it
from pdcluster.driver.health_monitor import PROBE_INTERVAL_S
from pdcluster.driver.instance import Instance
from pdcluster.driver.load_board import LoadBoard
from pdcluster.driver.messages import (
    Aborted,
    DecodeLost,
    Phases,
    TokenDelta,
)
from pdcluster.driver.recompute import MAX_RECOMPUTES, Recompute, recompute_refusal
from pdcluster.driver.registry import InstanceRegistry
from pdcluster.driver.request_state import Attempt, DriverRequest
from pdcluster.driver.router import POLICIES, PrefixCacheModel, RankRef
from pdcluster.driver.routing import ModelFacts, RouteAndReserve
from pdcluster.engine.sampling_params import SamplingParams

logger = logging.getLogger("pdcluster.driver.cluster")


class Dispatcher(RouteAndReserve):
    """The request path; its routing and reserving half is `driver.routing.RouteAndReserve`."""

    def __init__(
        self,
        registry: InstanceRegistry,
        loads: LoadBoard,
        topology: Topology,
        model: ModelFacts,
        call_timeout_s: float,
        event_timeout_s: float,
    ) -> None:
        self.registry = registry
        self._loads = loads
        self.topology = topology
        self.model = model
        self.call_timeout_s = call_timeout_s
        self.event_timeout_s = event_timeout_s
        self.hold_s = shrink_bound_s(topology.kv_transfer.timeout_s, PROBE_INTERVAL_S)
        self._elastic_prefill = elastic_ep(topology, "prefill")
        self.num_speculative_tokens = model.num_speculative_tokens
        self._policy = POLICIES[topology.router.policy]
        self._prefix_cache = PrefixCacheModel(topology.prefill.block_size)
        self._counter = itertools.count()
        self._requests: dict[str, DriverRequest] = {}  # request id -> its record
        self._by_handoff: dict[str, Attempt] = {}  # handoff id -> the attempt it names
        self._pollers: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.kv_transfer_bytes_total = 0
        self.kv_transfer_seconds_total = 0.0
        self.requests_recomputed_total = 0  # re-dispatches after a lost decode (`driver.recompute`)
        self.recomputed_tokens_total = 0
        self._closed = False

    @property
    def instances(self) -> dict[str, list[Instance]]:
        return self.registry.instances

    def close(self) -> None:
        """No new request; the poll loops stop."""
        self._closed = True
        for task in self._pollers:
            task.cancel()
        self._pollers = []

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        """Stream one request's output through prefill -> KV transfer -> decode.
        Raises ValueError: an empty prompt, a duplicate id, or a request no decode instance could hold."""
        if self._closed:
            raise BackendUnavailable("the cluster is shut down")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (no tokens)")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_pollers()
        # registered first: abort() may come before the first attempt exists
        record = self._requests[request_id] = DriverRequest(request_id, time.monotonic(), params=params)
        prompt, sampling = prompt_token_ids, params  # a re-dispatch after a lost decode changes both
        try:
            for attempt_index in range(MAX_DISPATCH_ATTEMPTS + MAX_RECOMPUTES):
                try:
                    attempt = await self._dispatch(record, attempt_index, prompt, sampling)
                except BackendUnavailable as e:
                    if record.lost is not None:
                        raise BackendUnavailable(
                            f"{request_id}: {record.lost}; its re-dispatch failed: {e}"
                        ) from e
                    if not record.errors:
                        raise
                    # A failed attempt and nowhere to re-dispatch: the client hears the attempt's cause.
                    raise BackendUnavailable(
                        f"{request_id}: KV handoff failed: {'; '.join(record.errors)}; {e}"
                    ) from e
                if attempt is None:  # aborted while dispatching (its reservation, if any, is released)
                    yield record.stream_delta()
                    return
                prefill_task = attempt.prefill_call  # sent by _dispatch (bound once decode reserved)
                assert prefill_task is not None
                action = None
                owner_gone = False
                try:
                    while not isinstance(action, Redispatch | Recompute | Fail):
                        for event in await self._next_events(record, attempt, prefill_task):
                            state = self._attempt_state(record, attempt, attempt_index, params)
                            action = next_action(state, event)
                            if isinstance(action, Emit):
                                delta = self._from_decode(record, attempt, action.delta)
                                if delta is not None:
                                    yield delta
                                if record.finished:
                                    return
                            elif isinstance(action, Prefilled):
                                attempt.advance(HandoffEvent.PREFILLED)
                                record.phases = record.phases.merged(Phases(queue_s=action.first.queue_s))
                                if action.emit:
                                    yield record.first_token_delta(attempt, action.first)
                            elif isinstance(action, Wait):
                                record.record_prefill(action.phases_from)
                            elif isinstance(action, EndAborted):
                                attempt.advance(HandoffEvent.ABORTED)
                                yield record.stream_delta()
                                return
                            else:
                                attempt.advance(HandoffEvent.FAILED)
                                break
                except (asyncio.CancelledError, GeneratorExit):
                    owner_gone = True  # the consumer went away (the HTTP client disconnected)
                    raise
                finally:
                    self._by_handoff.pop(attempt.handoff_id, None)
                    if not record.finished and not prefill_task.done() and not owner_gone:
                        if not record.aborted:  # (released by the outer `finally` / by abort())
                            prefill_task.cancel()
                self._release(attempt)
                if isinstance(action, Fail):
                    raise BackendUnavailable(action.message)
                if isinstance(action, Recompute):
                    resumed = record.recompute(action.error, prompt_token_ids, params)
                    prompt, sampling, n = (
                        resumed.prompt_token_ids,
                        resumed.params,
                        resumed.num_recomputed_tokens,
                    )
                    self.requests_recomputed_total += 1
                    self.recomputed_tokens_total += n
                    logger.warning(
                        "%s: %s; re-dispatched with the %d tokens streamed kept", request_id, action.error, n
                    )
                    continue
                record.errors.append(action.error)
                if action.excluded_prefill is not None:
                    record.excluded_prefills.add(action.excluded_prefill)
                logger.warning("%s: %s", request_id, action.error)
            raise BackendUnavailable(f"{request_id}: KV handoff failed: " + "; ".join(record.errors))
        finally:
            self._requests.pop(request_id, None)
            if record.attempt is not None and not record.finished:
                self._release(record.attempt)

    async def abort(self, request_id: str) -> None:
        """End the request with finish_reason "abort" and free it on both pools (prefill job and handoff,
        decode reservation or running request). Never re-dispatched. Unknown or finished ids: no-op."""
        record = self._requests.get(request_id)
        if record is None or record.aborted:
            return
        record.aborted = True
        attempt = record.attempt
        if attempt is None:  # between attempts / still routing: `_dispatch` sees `aborted`
            return
        self._release(attempt)
        attempt.events.put_nowait(Aborted(attempt.handoff_id))

    # ---- one attempt ------------------------------------------------------------------------------------
    def _from_decode(self, record: DriverRequest, attempt: Attempt, delta: TokenDelta) -> StreamDelta | None:
        first_of_attempt = not decode_has_it(attempt.state)
        if first_of_attempt:  # its KV was received, then the request admitted
            attempt.advance(HandoffEvent.TRANSFERRED, HandoffEvent.ADMITTED)
        if delta.finished:
            attempt.advance(HandoffEvent.FINISHED)
        if delta.phases.kv_transfer_s is not None and first_of_attempt:
            self.kv_transfer_seconds_total += delta.phases.kv_transfer_s
            self.kv_transfer_bytes_total += delta.kv_transfer_bytes or 0
        record.phases = record.phases.merged(delta.phases)
        if delta.kv_transfer_bytes is not None:
            record.kv_transfer_bytes = delta.kv_transfer_bytes
        record.decode_streamed = record.decode_streamed or bool(delta.new_token_ids)
        record.finished = delta.finished
        if not (delta.new_token_ids or delta.new_text or delta.finished):
            return None
        return record.stream_delta(delta)

    def _attempt_state(
        self, record: DriverRequest, attempt: Attempt, attempt_index: int, params: SamplingParams
    ) -> AttemptState:
        decode = self.instances["decode"][attempt.decode_index]
        tried = record.excluded_prefills | {attempt.prefill_index}
        others = [p for p in self.instances["prefill"] if p.accepting and p.index not in tried]
        return AttemptState(
            request_id=record.request_id,
            attempt_index=attempt_index,
            prefill_instance=attempt.prefill_index,
            decode_instance=attempt.decode_index,
            decode_streamed=record.decode_streamed,
            first_token_streamed=record.first_token is not None,
            earlier_errors=tuple(record.errors),
            decode_down_reason=None if decode.routable else decode.health.reason,
            num_other_prefills=len(others),
            prefill_routable=self.instances["prefill"][attempt.prefill_index].routable,
            event_timeout_s=self.event_timeout_s,
            max_attempts=MAX_DISPATCH_ATTEMPTS + record.num_recomputes,
            recompute_refusal=recompute_refusal(
                params, record.num_recomputes, record.aborted, record.finished
            ),
        )

    async def _next_events(
        self, record: DriverRequest, attempt: Attempt, prefill_task: asyncio.Future
    ) -> list[Event]:
        getter = asyncio.ensure_future(attempt.events.get())
        # The prefill call is sent while decode reserves, so it may have replied (or failed) before the first
        # wait: each of its two replies is waited on until taken.
        reply = attempt.prefill_first if not attempt.first_reported else prefill_task
        waits = {getter, reply} if not attempt.prefill_reported else {getter}
        decode = self.instances["decode"][attempt.decode_index]
        try:
            done = await wait_first(
                waits, self.event_timeout_s, self.hold_s, lambda: not record.aborted and held(decode, attempt)
            )
        finally:  # also when the client went away (this task cancelled): no pending getter left behind
            if not getter.done():
                getter.cancel()
        if record.aborted:
            return [Aborted(attempt.handoff_id)]
        if not done:
            return [NoEvent()]
        if getter not in done:  # a prefill reply came first
            return [self._prefill_outcome(attempt, prefill_task)]
        event = getter.result()
        if attempt.prefill_reported or not isinstance(event, TokenDelta):
            return [event]
        # Decode's first delta: the prefill call's replies (sent before its KV's end) are taken first.
        await asyncio.wait({prefill_task}, timeout=self.event_timeout_s)
        if not prefill_task.done():
            return [NoEvent()]
        outcomes = [self._prefill_outcome(attempt, prefill_task)]
        if not attempt.prefill_reported:
            outcomes.append(self._prefill_outcome(attempt, prefill_task))
        return [*outcomes, event]

    def _prefill_outcome(self, attempt: Attempt, prefill_task: asyncio.Future) -> Event:
        """`PrefillSampled` of the attempt's first prefill reply, then `PrefillDone` of its last; or
        `PrefillFailed` when the call failed."""
        first_failed: BaseException | None = None
        if not attempt.first_reported:
            attempt.first_reported = True
            assert attempt.prefill_first is not None
            first_failed = attempt.prefill_first.exception()
            if first_failed is None:
                return PrefillSampled(attempt.prefill_first.result())
        attempt.prefill_reported = True
        if not prefill_task.done():  # the first reply failed before the last: the call failed with it
            prefill_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        exc = prefill_task.exception() if prefill_task.done() else first_failed
        if exc is None:
            return PrefillDone(prefill_task.result())
        if isinstance(exc, asyncio.TimeoutError):
            exc = TimeoutError(f"no answer within {self.event_timeout_s:.0f} s")
        lost, prefill = self._is_lost(exc), self.instances["prefill"][attempt.prefill_index]
        event = elastic_attempts.prefill_failed(prefill, self._elastic_prefill, describe_error(exc), lost)
        if lost or event.reforming:  # out of routing until it answers again / re-formed
            self.registry.mark_failed("prefill", prefill.index, exc, "prefill", attempt.prefill_sent_s)
        return event

    # ---- an instance lost ---------------------------------------------------------------------------------
    def fail_attempts(self, role: str, index: int, keep: Mapping[int, int] | None = None) -> None:
        """End every in-flight attempt on instance (`role`, `index`) (`DecodeLost` / `PrefillFailed`) but
        those `keep` keeps (`driver.elastic_requests.kept`); from any thread (run on the requests' loop)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(
                        self._fail_attempts_on_loop, role, index, self._why(role, index), keep
                    )
                return
        self._fail_attempts_on_loop(role, index, self._why(role, index), keep)

    def _why(self, role: str, index: int) -> str:
        """Why instance (`role`, `index`) left routing, as its health says now."""
        instances = self.instances[role]  # empty once shut down
        return (
            instances[index].health.reason if index < len(instances) else "the cluster shut down"
        ) or "unknown"

    def _fail_attempts_on_loop(self, role: str, index: int, reason: str, keep: Mapping | None) -> None:
        """On the requests' event loop: `fail_attempts`, with `reason` as seen when the failure was."""
        for attempt in list(self._by_handoff.values()):
            if role == "decode" and attempt.decode_index == index and kept(attempt, index, keep):
                continue
            if role == "decode" and attempt.decode_index == index:
                message = f"decode-{index} died or stopped answering ({reason}); the request was lost"
                event: object = DecodeLost(attempt.handoff_id, message)
            elif role == "prefill" and attempt.prefill_index == index and _prefill_pending(attempt):
                event = elastic_attempts.prefill_lost(
                    attempt, self.instances["prefill"][index], self._elastic_prefill, reason, keep
                )
            else:
                continue
            with contextlib.suppress(RuntimeError):  # a queue of another (closed) event loop
                attempt.events.put_nowait(event)

    # ---- the poll loops -----------------------------------------------------------------------------------
    def _ensure_pollers(self) -> None:
        """One poll task per decode rank on the requests' loop (ranks an instance grew since included)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._pollers = loop, []
        polled = {task.get_name() for task in self._pollers if not task.done()}
        self._pollers += [
            loop.create_task(self._poll(instance.index, rank), name=f"poll-{instance.index}.{rank}")
            for instance in self.instances["decode"]
            for rank in range(instance.num_ranks)
            if f"poll-{instance.index}.{rank}" not in polled
        ]

    async def _poll(self, decode_index: int, rank: int = 0) -> None:
        instance = self.instances["decode"][decode_index]
        task = asyncio.current_task()
        while not self._closed and rank < instance.num_ranks:  # (an instance may shrink: driver.elastic)
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            if not instance.routable:
                await asyncio.sleep(PROBE_INTERVAL_S / 4)
                continue
            sent_s, client = time.monotonic(), instance.client(rank)
            try:
                events, load = await client.events(POLL_WAIT_S, self.call_timeout_s + POLL_WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a dead or stuck decode rank fails its instance
                if rank < instance.num_ranks and instance.client(rank) is client:  # (else shrunk away)
                    self.registry.mark_failed("decode", decode_index, e, f"poll of rank {rank}", sent_s)
                continue
            if (
                instance.routable and rank < instance.num_ranks and instance.client(rank) is client
            ):  # (a reply that raced the instance leaving routing is stale)
                self._loads.update_decode(RankRef(decode_index, rank), load)
            for event in events:
                attempt = self._by_handoff.get(event.handoff_id)
                if attempt is not None:
                    attempt.events.put_nowait(event)


def _prefill_pending(attempt: Attempt) -> bool:
    """The attempt's prefill call was sent and has not returned (a prefill lost after that lost nothing)."""
    call = attempt.prefill_call
    return call is not None and not call.done() and not attempt.prefill_reported
