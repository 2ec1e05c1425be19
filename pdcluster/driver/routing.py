"""Routing and reserving one dispatch attempt of a request, and releasing it (`driver.cluster`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pdcluster.config import ROLES
from pdcluster.driver.actor_errors import InstanceGroupFailed, describe_error
from pdcluster.driver.backend import BackendUnavailable
from pdcluster.driver.dispatch import (
    EndAborted,
    Fail,
    PrefillFailed,
    ReserveOutcome,
    RetryReserve,
    StartPrefill,
    after_reserve,
)
from pdcluster.driver.elastic import elastic_ep
from pdcluster.driver.elastic_requests import reforming
from pdcluster.driver.handoff import HandoffEvent
from pdcluster.driver.instance import Instance, check_instance_group
from pdcluster.driver.load_board import LoadBoard
from pdcluster.driver.messages import Phases, PrefillBind, PrefillRequest, ReserveRequest, ReserveResult
from pdcluster.driver.rank_wire import RankConnectionLost
from pdcluster.driver.registry import InstanceRegistry
from pdcluster.driver.request_state import Attempt, DriverRequest
from pdcluster.driver.router import DecodeLoad, PrefillLoad, RankRef
from pdcluster.engine.kv_precision import KVPrecisionPolicy, request_kv_cache_dtype
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kvtransfer.base import HandoffMeta, resolve_wire_dtype

MAX_EARLY_PREFILL_CALLS = 64
RECOVERY_POLL_S = 0.05  # with no live instance but one that may shrink and return: look again this often


@dataclass(frozen=True)
class ModelFacts:
    """What the driver puts in each handoff's `HandoffMeta`: the model's layers and KV width (prefill's
    `NodeReady`), its MTP drafts per step, and the dtypes (`dtype`, decode's `kv_cache_dtype`, the
    `kv_precision` policy).
    """

    num_hidden_layers: int
    kv_dim: int
    num_speculative_tokens: int
    dtype: str
    decode_kv_cache_dtype: str
    kv_precision: KVPrecisionPolicy | None = None


class RouteAndReserve:
    """The routing half of `driver.request_dispatch.Dispatcher` (its state is the Dispatcher's)."""

    instances: dict[str, list[Instance]]
    registry: InstanceRegistry
    model: ModelFacts
    _by_handoff: dict[str, Attempt]
    _loads: LoadBoard
    hold_s: float  # an instance re-forming (elastic EP) is waited for this long at most

    async def _dispatch(
        self,
        record: DriverRequest,
        attempt_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> Attempt | None:
        """Route: send prefill at once, reserve on decode (retrying), then bind the prefill's meta."""
        started: list[Attempt] = []
        try:
            attempt, done = await self._route_and_reserve(
                record, attempt_index, prompt_token_ids, params, started
            )
        except BaseException:
            for attempt in started:
                self._drop(attempt)
            raise
        if attempt is not None and not done:
            self._drop(attempt)
            return None
        return attempt

    def _drop(self, attempt: Attempt) -> None:
        """Release `attempt` on both instances (the prefill rank takes the abort after its prefill)."""
        self._release(attempt)

    async def _route_and_reserve(
        self,
        record: DriverRequest,
        attempt_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        started: list[Attempt],
    ) -> tuple[Attempt | None, bool]:
        """`_dispatch`'s loop: (the attempt, True) to go on with; (the attempt or None, False): aborted."""
        request_id = record.request_id
        deadline_s = time.monotonic() + self.topology.kv_transfer.timeout_s
        recover_until_s = time.monotonic() + self.hold_s
        attempt: Attempt | None = None
        first_token_id = None if record.first_token is None else record.first_token[0]
        while True:
            routing_started_s = time.monotonic()
            if record.aborted:
                return attempt, False
            if attempt is not None and attempt.prefill_call is not None:
                prefill_instance = self.instances["prefill"][attempt.prefill_index]
                assert attempt.prefill_call is not None
                if attempt.prefill_call.done() or not prefill_instance.routable:
                    # lost before its bind: the caller's policy re-dispatches it (PrefillFailed)
                    self._by_handoff[attempt.handoff_id] = attempt
                    record.attempt = attempt
                    if attempt.prefill_call.done():  # it ended unbound (failed): its replies are not taken
                        attempt.first_reported = attempt.prefill_reported = True
                        call = attempt.prefill_call
                        error = call.exception() if not call.cancelled() else None
                        for reply in (attempt.prefill_first, call):
                            if reply is not None:
                                reply.add_done_callback(lambda t: t.cancelled() or t.exception())
                        why = describe_error(error) if error is not None else "cancelled"
                        again = reforming(prefill_instance, elastic_ep(self.topology, "prefill"), why)
                        attempt.events.put_nowait(
                            PrefillFailed(f"ended before decode reserved: {why}", reforming=again)
                        )
                    else:
                        reason = prefill_instance.health.reason or "out of routing"
                        again = reforming(prefill_instance, elastic_ep(self.topology, "prefill"))
                        attempt.events.put_nowait(
                            PrefillFailed(f"died or stopped answering ({reason})", reforming=again)
                        )
                    return attempt, True
                prefills = [prefill_instance]
            else:
                prefills = [
                    p
                    for p in self.instances["prefill"]
                    if p.accepting and p.index not in record.excluded_prefills
                ]
            missing = not prefills or not any(d.accepting for d in self.instances["decode"])
            recovering = any(i.may_recover and not i.routable for role in ROLES for i in self.instances[role])
            if missing and recovering and time.monotonic() < recover_until_s:
                await asyncio.sleep(RECOVERY_POLL_S)
                continue
            if not prefills:
                if record.excluded_prefills:
                    raise BackendUnavailable("no other live prefill instance to re-dispatch to")
                summary = self.registry.summary("prefill")
                raise BackendUnavailable(f"{request_id}: no live prefill instance ({summary})")
            decodes = [d for d in self.instances["decode"] if d.accepting]
            if not decodes:
                raise BackendUnavailable(
                    f"{request_id}: no live decode instance ({self.registry.summary('decode')})"
                )
            lost = await self._load_missing_decodes(decodes)
            decode_loads: list[DecodeLoad] = []
            for d in decodes if not lost else ():
                try:
                    check_instance_group(self._loads.decode_snapshots(d.index))
                except InstanceGroupFailed as e:
                    self.registry.mark_failed("decode", d.index, e, "load")
                    lost = True
                    continue
                decode_loads.extend(self._loads.decode_loads(d.index))
            bound = None
            if lost:
                outcome = ReserveOutcome.INSTANCE_LOST
            elif record.aborted:
                outcome = ReserveOutcome.ABORTED
            else:
                cached = self._prefix_cache.cached
                prefill_ranks = (
                    [attempt.prefill]
                    if attempt is not None and attempt.prefill_call is not None
                    else [RankRef(p.index, r) for p in prefills for r in range(p.num_ranks)]
                )
                choice = self._policy(
                    [
                        PrefillLoad(
                            rank.instance, self._loads.prefill_queued_tokens(rank), cached(rank), rank.rank
                        )
                        for rank in prefill_ranks
                    ],
                    decode_loads,
                    counter=next(self._counter),
                    prompt_token_ids=prompt_token_ids,
                    block_size=self.topology.prefill.block_size,
                )
                if attempt is None or attempt.prefill_call is None:
                    attempt = Attempt(f"{request_id}@{attempt_index}", choice.prefill, choice.decode)
                    if self._loads.prefill_calls(attempt.prefill) < MAX_EARLY_PREFILL_CALLS:
                        self._start_prefill(attempt, prompt_token_ids, params, first_token_id)
                        started.append(attempt)
                else:
                    attempt.decode = choice.decode
                reserve_started_s = time.monotonic()
                outcome, bound = await self._reserve(record, attempt, prompt_token_ids, params)
                record.phases = record.phases.merged(
                    Phases(
                        route_s=reserve_started_s - routing_started_s,
                        reserve_s=time.monotonic() - reserve_started_s,
                    )
                )
            action = after_reserve(request_id, outcome, time.monotonic(), deadline_s)
            if isinstance(action, StartPrefill):
                assert attempt is not None and bound is not None
                attempt.meta = bound
                attempt.advance(HandoffEvent.BOUND)
                if attempt.prefill_call is None:
                    self._start_prefill(attempt, prompt_token_ids, params, first_token_id)
                    started.append(attempt)
                else:
                    self._bind_prefill(attempt)
                self._prefix_cache.record(attempt.prefill, prompt_token_ids)
                return attempt, True
            if isinstance(action, EndAborted):
                return attempt, False
            if isinstance(action, Fail):
                raise BackendUnavailable(action.message)
            if isinstance(action, RetryReserve):
                await asyncio.sleep(action.delay_s)

    def _start_prefill(
        self,
        attempt: Attempt,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token_id: int | None = None,
    ) -> None:
        """Send `attempt`'s prefill call now, with its bound meta once reserved, else awaiting its bind."""
        request = PrefillRequest(
            attempt.handoff_id,
            tuple(prompt_token_ids),
            params,
            attempt.meta or self._meta(attempt, prompt_token_ids, params),
            attempt.decode_index,
            attempt.decode.rank,
            awaiting_bind=attempt.meta is None,
            first_token_id=first_token_id,
        )
        client = self.instances["prefill"][attempt.prefill_index].client(attempt.prefill.rank)
        first, call = client.prefill(request, self.event_timeout_s + self.topology.kv_transfer.timeout_s)
        attempt.prefill_first, attempt.prefill_call, attempt.prefill_sent_s = first, call, time.monotonic()
        rank, num_tokens = attempt.prefill, len(prompt_token_ids)
        self._loads.prefill_started(rank, num_tokens)
        call.add_done_callback(lambda _: self._loads.prefill_ended(rank, num_tokens))
        call.add_done_callback(lambda c: c.cancelled() or c.exception())

    def _bind_prefill(self, attempt: Attempt) -> None:
        """Hand `attempt`'s running prefill the meta decode bound (`PrefillWorker.bind`)."""
        assert attempt.meta is not None
        bind = PrefillBind(attempt.handoff_id, attempt.meta, attempt.decode_index, attempt.decode.rank)
        self.instances["prefill"][attempt.prefill_index].client(attempt.prefill.rank).bind(bind)

    async def _load_missing_decodes(self, decodes: list[Instance]) -> bool:
        """Load into the board the decode instances of `decodes` no snapshot has reached yet."""
        missing = set(self._loads.missing_decodes(d.index for d in decodes))
        if not missing:
            return False

        async def ranks(instance: Instance) -> list[Any]:
            loads = list(await asyncio.gather(*[c.load(self.call_timeout_s) for c in instance.clients]))
            check_instance_group(loads)
            return loads

        targets = [d for d in decodes if d.index in missing]
        sent_s = time.monotonic()
        results = await asyncio.gather(*[ranks(d) for d in targets], return_exceptions=True)
        lost = False
        for instance, r in zip(targets, results, strict=True):
            if isinstance(r, BaseException):
                if not self._is_lost(r):
                    raise r
                self.registry.mark_failed(instance.role, instance.index, r, "load", sent_s)
                lost = True
                continue
            for rank, load in enumerate(r):
                self._loads.update_decode(RankRef(instance.index, rank), load)
        return lost

    async def _reserve(
        self, record: DriverRequest, attempt: Attempt, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[ReserveOutcome, HandoffMeta | None]:
        """Reserve `attempt` on its decode rank: the outcome and the bound meta (when BOUND)."""
        self._by_handoff[attempt.handoff_id] = attempt
        record.attempt = attempt
        reserve = ReserveRequest(
            attempt.handoff_id,
            tuple(prompt_token_ids),
            params,
            self._meta(attempt, prompt_token_ids, params),
            self.num_speculative_tokens,
        )
        decode = self.instances["decode"][attempt.decode_index].client(attempt.decode.rank)
        epoch = self._loads.reserve_sent(attempt.decode)
        sent_s = time.monotonic()
        reserve_call = asyncio.ensure_future(decode.reserve(reserve, self.call_timeout_s))
        answered: ReserveResult | None = None
        try:
            answered = await asyncio.shield(reserve_call)
            result: ReserveResult = answered
        except asyncio.CancelledError:
            self._by_handoff.pop(attempt.handoff_id, None)
            record.attempt = None
            self._release(attempt)
            self._release_when_done(attempt, reserve_call)
            raise
        except BaseException as e:
            self._by_handoff.pop(attempt.handoff_id, None)
            record.attempt = None
            if not self._is_lost(e):
                raise
            self._release(attempt)
            self.registry.mark_failed("decode", attempt.decode_index, e, "reserve", sent_s)
            attempt.advance(HandoffEvent.REROUTED)
            return ReserveOutcome.INSTANCE_LOST, None
        finally:
            self._loads.reserve_answered(attempt.decode, None if answered is None else answered.load, epoch)
        if record.aborted:
            self._by_handoff.pop(attempt.handoff_id, None)
            self._release(attempt)
            attempt.advance(HandoffEvent.ABORTED)
            return ReserveOutcome.ABORTED, None
        if result.reserved:
            attempt.advance(HandoffEvent.RESERVED)
            return ReserveOutcome.BOUND, result.bound_meta
        self._by_handoff.pop(attempt.handoff_id, None)
        record.attempt = None
        attempt.advance(HandoffEvent.REROUTED)
        return ReserveOutcome.NO_ROOM, None

    def _meta(self, attempt: Attempt, prompt_token_ids: list[int], params: SamplingParams) -> HandoffMeta:
        kv = self.topology.kv_transfer
        kv_dtype = request_kv_cache_dtype(
            self.model.kv_precision,
            self.model.decode_kv_cache_dtype,
            len(prompt_token_ids),
            params.max_tokens,
        )
        return HandoffMeta(
            request_id=attempt.handoff_id,
            num_layers=self.model.num_hidden_layers + (1 if self.model.num_speculative_tokens else 0),
            num_tokens=len(prompt_token_ids),
            kv_dim=self.model.kv_dim,
            dtype=self.model.dtype,
            wire_dtype=resolve_wire_dtype(kv.wire_dtype, self.model.dtype, kv_dtype),
            lease_s=kv.timeout_s,
        )

    async def _call(self, ref, timeout_s: float | None = None):
        """Await one actor call; asyncio.TimeoutError after `timeout_s` (default `call_timeout_s`)."""
        return await asyncio.wait_for(ref, timeout_s if timeout_s is not None else self.call_timeout_s)

    @staticmethod
    def _is_lost(exc: BaseException) -> bool:
        """The actor died or stopped answering, or its group failed (not a method that raised)."""
        import ray

        lost = (
            ray.exceptions.RayActorError,
            RankConnectionLost,
            asyncio.TimeoutError,
            TimeoutError,
            InstanceGroupFailed,
        )
        return isinstance(exc, lost)

    def _release_when_done(self, attempt: Attempt, call: asyncio.Future) -> None:
        """Release `attempt` again once the actor call `call` has ended, whatever its outcome."""
        if call.done():
            return

        def again(task: asyncio.Future) -> None:
            if not task.cancelled():
                task.exception()
            if not self._closed:
                self._release(attempt)

        call.add_done_callback(again)

    def _release(self, attempt: Attempt) -> None:
        """Best effort, fire and forget: drop the attempt on all ranks of its prefill and decode instances."""
        for role, index in (("decode", attempt.decode_index), ("prefill", attempt.prefill_index)):
            for client in self.instances[role][index].clients:
                client.abort(attempt.handoff_id)
