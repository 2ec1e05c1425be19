"""`DecodeWorker`: the decode role, a thin shell around one `LLMEngine` and one `KVReceiver`."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from pdcluster.driver.dispatch import call_timeout_s
from pdcluster.driver.fair_lock import FairLock
from pdcluster.driver.messages import (
    DecodeEvent,
    DecodeNodeLoad,
    InstanceGroupSpec,
    NodeReady,
    PolledEvent,
    PollReply,
    RequestError,
    ReserveRequest,
    ReserveResult,
)
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm import EngineStepError, RequestOutput
from pdcluster.kvtransfer.base import HandoffMeta, KVReceiver, KVTransferError, ReceivedKV, ReceivedLayer
from pdcluster.kvtransfer.paired import PairedAddress
from pdcluster.workers.decode_deltas import Handoff, admit, token_delta
from pdcluster.workers.decode_receivers import DecodeReceivers
from pdcluster.workers.rank import LOCKSTEP_IDLE_S, RankWorker

if TYPE_CHECKING:
    from pdcluster.kvtransfer.grpc_transport import TLSCredentials

logger = logging.getLogger(__name__)


class DecodeWorker(RankWorker):
    """One decode rank (of an instance of one or more)."""

    # "before_reserve", "after_reserve" (a reserve call), "before_admit" (a received handoff, no lock held),
    # "admit", "step", "delta" (turning an output into events), "loop" (the pass, under the engine lock),
    # "grow" (switching to a grown group, `workers.elastic_rank.grow`)
    CHECKPOINTS = (
        "before_reserve",
        "after_reserve",
        "before_admit",
        "admit",
        "step",
        "delta",
        "loop",
        "grow",
    )
    SHARED_KV_CACHE = True

    def __init__(
        self,
        engine_config: EngineConfig,
        name: str,
        host: str = "127.0.0.1",
        group: InstanceGroupSpec | None = None,
    ) -> None:
        super().__init__(engine_config, name, group)
        self.host = host
        self.receiver: KVReceiver | None = None
        self._engine_lock = FairLock()
        self._alloc_lock = FairLock()
        self._step_started_s: float | None = None
        self._events_lock = threading.Condition()
        self._events: collections.deque[PolledEvent] = collections.deque()
        self._next_seq = 0
        # received handoffs the engine thread admits at its next pass (appended without the engine lock)
        self._admissions_lock = threading.Lock()
        self._admissions: list[tuple[str, ReceivedKV]] = []
        self._handoffs: dict[str, Handoff] = {}
        self._received_at_s: dict[str, float] = {}
        self._fenced: set[str] = set()
        self._wakeup = threading.Event()
        self.receivers = DecodeReceivers(self)
        # A lost peer rolls the step back: this rank's requests keep their KV until the driver re-forms
        # the group (`driver.elastic`) or gives up on them (its abort drops them).
        self.engine.hold_on_ep_failure = True
        self._start_engine_thread()

    def ready(self) -> NodeReady:
        """Name, process id, load time and what `compile` did, once the engine is loaded (weights read and,
        with `compile`, the decode forward compiled: Ray runs no call before the constructor returns).
        """
        num_blocks = self.engine.scheduler.block_manager.num_blocks
        return NodeReady(self.name, os.getpid(), self.load_s, num_blocks, compile=self.engine.compile_stats())

    def start_grpc(self, tls: TLSCredentials | None = None) -> str:
        """`DecodeReceivers.start_grpc`."""
        return self.receivers.start_grpc(tls)

    def start_receiver(self, transport: str, tls: TLSCredentials | None = None) -> str | PairedAddress:
        """`DecodeReceivers.start_receiver`."""
        return self.receivers.start_receiver(transport, tls)

    def node_ip(self) -> str:
        """`DecodeReceivers.node_ip`."""
        return self.receivers.node_ip()

    def connect_dist(self, rank: int, world_size: int, init_method: str, prefill_ranks: list[int]) -> None:
        """`DecodeReceivers.connect_dist`."""
        self.receivers.connect_dist(rank, world_size, init_method, prefill_ranks)

    def reserve(self, request: ReserveRequest) -> ReserveResult:
        """Reserve blocks and expect the handoff (before prefill starts).
        Raises ValueError: a request this instance could never hold."""
        assert self.receiver is not None, "connect a transport first"
        self._checkpoint("before_reserve")
        engine = self.engine
        handoff_id, meta = request.handoff_id, request.meta
        with self._reserve_lock(meta.lease_s):
            reserved = engine.reserve_remote_prefill(
                handoff_id, list(request.prompt_token_ids), request.params, request.num_draft_tokens
            )
            if not reserved:
                return ReserveResult(None, self.load())

        def on_layer(layer_idx: int, layer: ReceivedLayer) -> int | None:
            # not verified yet: its CRC-32C is computed in the same pass as the copy; the receiver checks it
            checksum_start = None if layer.verified else 0
            return engine.write_prompt_kv(handoff_id, layer_idx, layer.latent, layer.scale, checksum_start)

        try:
            block_ids = engine.reserved_block_ids(handoff_id)
            bound = self.receiver.expect(meta, on_layer, on_layer_checksums=True, block_ids=block_ids)
        except Exception:
            with self._alloc_lock:
                engine.release_remote_prefill(handoff_id)
            raise
        threading.Thread(target=self._await_handoff, args=(meta,), daemon=True).start()
        self._checkpoint("after_reserve")
        return ReserveResult(bound, self.load())

    def abort(self, handoff_id: str) -> None:
        """Drop the request wherever it is (reserved or running); frees its blocks."""
        with self._locked():
            self._drop(handoff_id)

    def poll(
        self, timeout_s: float = 0.05, acked_seq: int = 0, sent_seq: int | None = None
    ) -> list[PolledEvent]:
        """Every event after `sent_seq` (default `acked_seq`; seq counts from 1), waiting up to `timeout_s`
        for one: a `TokenDelta` or a `RequestError` per event. Events up to `acked_seq` are forgotten."""
        after_seq = acked_seq if sent_seq is None else max(acked_seq, sent_seq)
        deadline_s = time.monotonic() + timeout_s
        with self._events_lock:
            while self._events and self._events[0].seq <= acked_seq:
                self._events.popleft()
            while not self._events or self._events[-1].seq <= after_seq:
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0 or self._stopped.is_set():
                    break
                self._events_lock.wait(remaining_s)
            return [e for e in self._events if e.seq > after_seq]

    def poll_with_load(self, timeout_s: float = 0.05, acked_seq: int = 0) -> PollReply:
        """`poll(timeout_s, acked_seq)` and this rank's `load()` taken as the reply leaves (the router's view
        without a `load` call per request: `driver.load_board`).
        """
        events = self.poll(timeout_s, acked_seq)
        return PollReply(events, self.load())

    def load(self) -> DecodeNodeLoad:
        """Cheap snapshot for the router: free KV blocks, batch size, reservations and admitted requests
        waiting for a seat in the batch.
        """
        scheduler = self.engine.scheduler
        bm = scheduler.block_manager
        return DecodeNodeLoad(
            name=self.name,
            pid=os.getpid(),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_running=len(scheduler.running),
            num_reserved=len(scheduler.reserved),
            num_waiting_for_seat=len(scheduler.waiting_for_seat),
            **self._engine_health(),
            taken_s=time.monotonic(),
        )

    def check_no_leaks(self) -> dict[str, Any]:
        """For tests: blocks held, reservations and unfinished requests once nothing is in flight."""
        with self._locked():
            scheduler = self.engine.scheduler
            bm = scheduler.block_manager
            return {
                "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
                "num_reserved": len(scheduler.reserved),
                "num_unfinished": len(scheduler.requests),
                "pending_handoffs": [] if self.receiver is None else self.receiver.pending_request_ids(),
            }

    def num_kv_segments(self) -> int:
        """For tests: `DecodeReceivers.num_kv_segments`."""
        return self.receivers.num_kv_segments()

    def kv_in_place_stats(self) -> dict[str, int]:
        """For tests: `DecodeReceivers.kv_in_place_stats`."""
        return self.receivers.kv_in_place_stats()

    def close(self) -> None:
        self._stop_engine_thread()
        if self.receiver is not None:
            try:
                self.receiver.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                logger.exception("%s: closing the receiver failed", self.name)

    def _await_handoff(self, meta: HandoffMeta) -> None:
        assert self.receiver is not None
        handoff_id = meta.request_id
        try:
            received = self.receiver.wait(handoff_id, meta.lease_s)
        except Exception as e:  # noqa: BLE001 - KVTransferError, KeyError, or a transport bug: never hang
            if not isinstance(e, KVTransferError | KeyError):
                logger.exception("%s: waiting for handoff %s failed", self.name, handoff_id)
            self.receiver.release(handoff_id)
            with self._locked():
                released = self._release_reserved(handoff_id)
                self._handoffs.pop(handoff_id, None)
            if released:
                self._emit([RequestError(handoff_id, f"{type(e).__name__}: {e}")])
            return
        self._checkpoint("before_admit")
        with self._admissions_lock:  # not the engine lock: a step may hold that (`_run_once` checks it)
            self._admissions.append((handoff_id, received))
            self._received_at_s[handoff_id] = time.monotonic()
        self._wakeup.set()

    def _run(self) -> None:
        """The engine thread."""
        while not self._stopped.is_set():
            with self._engine_pass():
                self._run_pass()

    def _run_pass(self) -> None:
        """One pass of the engine thread's loop (`_run`): wait a little for work, then `_run_once`."""
        engine = self.engine
        if self._group_error is not None:  # holding its requests (see __init__) until re-formed or aborted
            self._wakeup.wait(0.05)
            self._wakeup.clear()
            return
        if not engine.has_unfinished_requests() and not self._admissions and not self._checkpoint_armed():
            self._wakeup.wait(LOCKSTEP_IDLE_S if self.lockstep else 0.05)
            self._wakeup.clear()
            if not self.lockstep:
                return
        events: list[DecodeEvent] = []
        try:
            with self._locked():
                self._checkpoint("loop")
                self._run_once(events)
                self._refresh_ep_summary()
        except Exception as e:  # noqa: BLE001 - the last line of defence: fail everything in flight
            self._loop_error(e, "decode engine loop failed")
            with self._locked():
                events.extend(self._fail_all(f"decode engine loop failed: {e!r}"))
        self._emit(events)

    def _run_once(self, events: list[DecodeEvent]) -> None:
        """One pass under the engine lock: admit finished handoffs, step, turn outputs into events."""
        engine = self.engine
        with self._admissions_lock:
            admissions, self._admissions = self._admissions, []
        for handoff_id, received in admissions:
            if handoff_id not in engine.scheduler.reserved or handoff_id in self._fenced:
                with self._admissions_lock:  # dropped after it was received (`_drop`)
                    self._received_at_s.pop(handoff_id, None)
                continue
            try:
                events.extend(admit(self, handoff_id, received))
            except Exception as e:  # noqa: BLE001 - fails this request only
                self._loop_error(e, f"admitting {handoff_id} failed")
                events.append(self._fail(handoff_id, f"decode admission failed: {e!r}"))
        self._emit(list(events))
        events.clear()
        outputs: list[RequestOutput] = engine.pop_finished_outputs()
        if engine.has_unfinished_requests() or self.lockstep:
            try:
                self._checkpoint("step")
                self._step_started_s = time.monotonic()
                try:
                    outputs.extend(engine.step(while_executing=self._reserves_allowed))
                finally:
                    self._step_started_s = None
            except EngineStepError as e:
                self._loop_error(e, "engine step failed")
                outputs.extend(e.outputs)
                if self._group_failed(e) and e.outputs:  # (none: rolled back and held, see __init__)
                    events.extend(self._fail_all(f"decode step failed: {e}"))
            except Exception as e:  # noqa: BLE001 - not tied to requests: the engine state is unknown
                self._loop_error(e, "engine step failed")
                self._group_failed(e)
                events.extend(self._fail_all(f"decode step failed: {e!r}"))
        for out in outputs:
            try:
                self._checkpoint("delta")
                events.extend(self._delta(out))
            except Exception as e:  # noqa: BLE001 - fails this request only
                self._loop_error(e, f"reporting {out.request_id} failed")
                events.append(self._fail(out.request_id, f"decode output failed: {e!r}"))

    def _fail(self, handoff_id: str, message: str) -> RequestError:
        """Under the engine lock: `_drop` the request and return its error event."""
        self._drop(handoff_id)
        return RequestError(handoff_id, message)

    def _drop(self, handoff_id: str) -> None:
        """Under the engine lock: drop the request wherever it is and free its blocks."""
        assert self.receiver is not None
        try:
            self.receiver.release(handoff_id)
        except Exception:  # noqa: BLE001 - still free the engine side
            logger.exception("%s: releasing handoff %s failed", self.name, handoff_id)
        with self._admissions_lock:
            self._admissions = [(rid, kv) for rid, kv in self._admissions if rid != handoff_id]
            self._received_at_s.pop(handoff_id, None)
        self._release_reserved(handoff_id)
        self.engine.abort_request(handoff_id)
        self.engine.pop_finished_outputs([handoff_id])
        self._handoffs.pop(handoff_id, None)

    def _release_reserved(self, handoff_id: str) -> bool:
        """Under the engine lock: free a reservation's blocks now, or once no in-place writer remains."""
        if handoff_id not in self.engine.remote_prefills or handoff_id in self._fenced:
            return False
        # the cache's own fences (not the receiver's view): they outlive a receiver closed or replaced
        cache = self.engine.runner.shared_kv_cache
        if cache is not None and cache.fences.defer(handoff_id, lambda: self._free_fenced(handoff_id)):
            self._fenced.add(handoff_id)
            return True
        return self.engine.release_remote_prefill(handoff_id)

    def _free_fenced(self, handoff_id: str) -> None:
        """The in-place sender of a released reservation stopped writing: its blocks go back now."""
        with self._locked():
            self._fenced.discard(handoff_id)
            self.engine.release_remote_prefill(handoff_id)

    def _fail_all(self, message: str) -> list[RequestError]:
        """Under the engine lock: fail every admitted request on this rank; pending reservations are left."""
        scheduler = self.engine.scheduler
        ids = set(scheduler.requests) | set(self._handoffs)
        with self._admissions_lock:
            ids |= {rid for rid, _ in self._admissions}
        ids |= {out.request_id for out in self.engine.pop_finished_outputs()}
        return [self._fail(rid, message) for rid in sorted(ids)]

    def _wake_engine_thread(self) -> None:
        self._wakeup.set()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Both locks, in order: the engine to this thread alone (a step never runs meanwhile)."""
        with self._engine_lock, self._alloc_lock:
            yield

    def _reserve_lock(self, kv_timeout_s: float) -> AbstractContextManager[Any]:
        """The lock(s) a reserve takes: `_alloc_lock` alone, or both once a step has run too long."""
        started_s = self._step_started_s
        if started_s is not None and time.monotonic() - started_s > call_timeout_s(kv_timeout_s) / 2:
            return self._locked()
        return self._alloc_lock

    @contextlib.contextmanager
    def _reserves_allowed(self) -> Iterator[None]:
        """Engine thread mid-step: free `_alloc_lock` for reserves while the forward runs, then retake it."""
        self._alloc_lock.release()
        try:
            yield
        finally:
            self._alloc_lock.acquire()

    def _delta(self, out: RequestOutput) -> list[DecodeEvent]:
        rid = out.request_id
        if out.finish_reason == "error":
            return [self._fail(rid, f"decode failed: {out.error}")]
        delta = token_delta(out, self._handoffs.get(rid))
        if out.finished:
            self._handoffs.pop(rid, None)
        return [delta]

    def _emit(self, events: list[DecodeEvent]) -> None:
        """Number `events`, keep them until a poll acknowledges them, and wake the poll."""
        if not events:
            return
        with self._events_lock:
            first_seq = self._next_seq + 1
            self._events.extend(PolledEvent(first_seq + i, event) for i, event in enumerate(events))
            self._next_seq = first_seq + len(events) - 1
            self._events_lock.notify_all()
