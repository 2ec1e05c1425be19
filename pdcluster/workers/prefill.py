"""`PrefillWorker`: the prefill role, a thin shell around one `LLMEngine` and a `KVSender` per decode rank."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from pdcluster.driver.command_order import CommandOrder, CommandSeq
from pdcluster.driver.dispatch import CALL_TIMEOUT_MIN_S, event_timeout_s
from pdcluster.driver.elastic_requests import GROUP_FAILED
from pdcluster.driver.messages import (
    InstanceGroupSpec,
    NodeReady,
    PrefillBind,
    PrefillFirstToken,
    PrefillNodeLoad,
    PrefillRequest,
    PrefillResult,
)
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm import EngineStepError
from pdcluster.kvtransfer.base import KVSender
from pdcluster.kvtransfer.paired import PairedAddress
from pdcluster.workers.prefill_handover import HandOver
from pdcluster.workers.prefill_job import Job
from pdcluster.workers.prefill_senders import KVSenders
from pdcluster.workers.rank import LOCKSTEP_IDLE_S, RankWorker
from pdcluster.workers.thread_clock import run_delay_s

if TYPE_CHECKING:
    from pdcluster.kvtransfer.grpc_transport import TLSCredentials

logger = logging.getLogger(__name__)


class PrefillWorker(RankWorker):
    """One prefill rank (of an instance of one or more)."""

    # "start" (taking a job), "step", "complete" (handing a prefill over), "loop" (outside any request)
    CHECKPOINTS = ("start", "step", "complete", "loop")

    def __init__(
        self,
        engine_config: EngineConfig,
        name: str,
        layerwise: bool = True,
        group: InstanceGroupSpec | None = None,
    ) -> None:
        super().__init__(engine_config, name, group)
        self.layerwise = layerwise
        self.kv = KVSenders(name, self.engine.config.device)
        self.handover = HandOver(self)
        self._jobs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._active: dict[str, Job] = {}
        self._calls: dict[str, Job] = {}  # prefill_first calls whose prefill_result has not come yet
        # binds the engine thread has not taken yet (`_take_bind`)
        self._binds: dict[str, PrefillBind] = {}
        self._order = CommandOrder(CALL_TIMEOUT_MIN_S)  # prefill, bind, abort in the driver's order
        self._lock = threading.Lock()
        self._num_queued_tokens = 0  # of jobs queued or active
        self._start_engine_thread()

    # ---- wiring -----------------------------------------------------------------------------------------
    def ready(self) -> NodeReady:
        """Load time and model facts, once the weights are loaded."""
        cfg = self.engine.model.config
        num_blocks = self.engine.scheduler.block_manager.num_blocks
        return NodeReady(
            self.name,
            os.getpid(),
            self.load_s,
            num_blocks,
            cfg.num_hidden_layers,
            cfg.kv_cache_dim,
            compile=self.engine.compile_stats(),
        )

    @property
    def senders(self) -> list[list[KVSender]]:
        """`[decode instance][decode rank]`: the KV sender to that rank."""
        return self.kv.table

    def connect_grpc(self, decode_addresses: list[list[str]], tls: TLSCredentials | None = None) -> None:
        """`KVSenders.connect("grpc", ...)`."""
        self.kv.connect("grpc", decode_addresses, tls)

    def connect_receivers(self, transport: str, *addresses_and_tls: Any) -> None:
        """`KVSenders.connect` (the same arguments)."""
        self.kv.connect(transport, *addresses_and_tls)

    def sender_transports(self) -> list[list[str]]:
        """`KVSenders.transports`."""
        return self.kv.transports()

    def set_decode_address(
        self, decode_index: int, address: str | PairedAddress, decode_rank: int = 0
    ) -> None:
        """`KVSenders.replace`."""
        self.kv.replace(decode_index, address, decode_rank)

    def connect_dist(
        self, rank: int, world_size: int, init_method: str, decode_ranks: list[list[int]]
    ) -> None:
        """`KVSenders.connect_dist`."""
        self.kv.connect_dist(rank, world_size, init_method, decode_ranks)

    def _all_senders(self) -> list[KVSender]:
        return self.kv.all()

    def _sender(self, job: Job) -> KVSender:
        """The sender to the decode rank `job` goes to."""
        return self.kv.table[job.decode_index][job.decode_rank]

    # ---- requests ---------------------------------------------------------------------------------------
    def prefill(
        self, request: PrefillRequest, order: CommandSeq | None = None
    ) -> Iterator[PrefillFirstToken | PrefillResult]:
        """In-process: the replies of `prefill_first`, then of `prefill_result` (the driver calls each)."""
        yield self.prefill_first(request, order)
        yield self.prefill_result(request.handoff_id)

    def prefill_first(self, request: PrefillRequest, order: CommandSeq | None = None) -> PrefillFirstToken:
        """Start prefilling one request towards decode rank (`decode_index`, `decode_rank`) its reserve or
        `bind` bound; returns its `PrefillFirstToken` as the token is sampled (`prefill_result` takes the
        rest of the call). Raises RuntimeError when the prefill failed or timed out before its token."""
        job = Job(request)
        timeout_s = event_timeout_s(request.meta.lease_s) + (
            request.meta.lease_s if request.awaiting_bind else 0
        )
        job.deadline_s, job.timeout_s = time.monotonic() + timeout_s, timeout_s
        with self._order.turn(order):
            with self._lock:
                self._num_queued_tokens += job.num_prompt_tokens
                self._calls[job.request_id] = job
            self._jobs.put(("add", job))
        return self._wait(job, job.sampled, "first")

    def prefill_result(self, handoff_id: str, order: CommandSeq | None = None) -> PrefillResult:
        """The `PrefillResult` of the `prefill_first` call of `handoff_id` (commanded before this), once its
        KV is handed over. Raises RuntimeError when the prefill or the send failed or timed out (the
        handoff is aborted), or no such call came."""
        with self._order.turn(order), self._lock:
            job = self._calls.pop(handoff_id, None)
        if job is None:
            raise RuntimeError(f"{self.name}: no prefill call of {handoff_id} to answer")
        return self._wait(job, job.done, "result")

    def _wait(self, job: Job, event: threading.Event, reply: str) -> PrefillFirstToken | PrefillResult:
        """`job.<reply>` once `event` is set (a first token sampled before a later failure still goes out).
        RuntimeError: timed out by `job.deadline_s` (the job aborted), or failed without that reply."""
        if not event.wait(max(0.0, job.deadline_s - time.monotonic())):
            self._jobs.put(("abort", job.request_id))
            raise RuntimeError(f"{self.name}: prefill of {job.request_id} not done after {job.timeout_s:g} s")
        if getattr(job, reply) is None or (reply == "result" and job.error is not None):
            raise RuntimeError(f"{self.name}: prefill of {job.request_id} failed: {job.error}")
        return getattr(job, reply)

    def bind(self, bind: PrefillBind, order: CommandSeq | None = None) -> None:
        """Bind a request sent `awaiting_bind`: its handoff to the decode rank named in `bind.meta` begins,
        and the KV computed so far goes out."""
        with self._order.turn(order):
            with self._lock:
                self._binds[bind.handoff_id] = bind
            self._jobs.put(("bind", bind.handoff_id))

    def abort(self, request_id: str, order: CommandSeq | None = None) -> None:
        """Fail the prefill of `request_id` (its `prefill` call raises), freeing its blocks and handoff."""
        with self._order.turn(order):
            self._jobs.put(("abort", request_id))

    def load(self) -> PrefillNodeLoad:
        """Cheap snapshot for the router: queued prompt tokens and requests in flight."""
        with self._lock:
            return PrefillNodeLoad(
                name=self.name,
                pid=os.getpid(),
                num_queued_prefill_tokens=self._num_queued_tokens,
                num_requests=len(self._active),
                **self._engine_health(),
            )

    def check_no_leaks(self) -> dict[str, Any]:
        """For tests: blocks held and handoffs still open once nothing is in flight. No `flush` first: a
        sender must forget a handoff by itself once it is delivered or failed, or this reports it."""
        bm = self.engine.scheduler.block_manager
        with self._lock:
            return {
                "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
                "num_active": len(self._active),
                "pending_handoffs": [rid for s in self._all_senders() for rid in s.pending_request_ids()],
            }

    def close(self) -> None:
        """Stop the engine thread, fail every job still waiting (their `prefill` calls raise at once), close
        the senders."""
        self._jobs.put(("stop", None))
        self._stop_engine_thread()
        waiting = list(self._active.values())
        while True:
            try:
                kind, arg = self._jobs.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                waiting.append(arg)
        for job in waiting:
            job.error = f"{self.name} is closing"
            job.wake()
        for sender in self._all_senders():
            try:
                sender.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                logger.exception("%s: closing a sender failed", self.name)

    # ---- engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            with self._engine_pass():
                try:
                    if not self._run_once():
                        return
                except Exception as e:  # noqa: BLE001 - the last line of defence: fail everything in flight
                    self._loop_error(e, "prefill engine loop failed")
                    for request_id in list(self._active):
                        self._fail(request_id, f"prefill engine loop failed: {e!r}", abort_engine=True)

    def _run_once(self) -> bool:
        """Take queued commands, run one step."""
        engine = self.engine
        block = not engine.has_unfinished_requests()
        try:
            if block:
                stepping = self.lockstep and self._group_error is None
                command = self._jobs.get(timeout=LOCKSTEP_IDLE_S if stepping else 0.1)
            else:
                command = self._jobs.get_nowait()
        except queue.Empty:
            command = None
        while command is not None:
            kind, arg = command
            if kind == "stop":
                return False
            if kind == "add":
                self._start(arg)
            elif kind == "bind":
                bind = self._take_bind(arg)
                if bind is not None:  # (else taken already, mid-step)
                    self.handover.bind(bind)
            elif kind == "abort":
                self._take_bind(arg)
                if arg in self._active:
                    self._fail(arg, "aborted by the router", abort_engine=True)
            try:
                command = self._jobs.get_nowait()
            except queue.Empty:
                command = None
        self._checkpoint("loop")
        if self._group_error is not None or (not engine.has_unfinished_requests() and not self.lockstep):
            return True
        in_engine = [job for job in self._active.values() if job.pending is None]  # (not prefilled yet)
        wait_before_s = run_delay_s()
        try:
            self._checkpoint("step")
            outputs = engine.step(on_prompt_kv=self._on_prompt_kv, on_first_token=self.handover.first_token)
        except EngineStepError as e:  # the step's requests are finished with an error; others go on
            self._loop_error(e, "engine step failed")
            outputs = e.outputs
            if self._group_failed(e):  # a peer rank died or stalled: nothing here can step again
                for request_id in list(self._active):
                    self._fail(request_id, f"engine step failed: {GROUP_FAILED}: {e}", abort_engine=True)
        except Exception as e:  # noqa: BLE001 - not tied to requests: fail them all, not the actor
            self._loop_error(e, "engine step failed")
            why = f"{GROUP_FAILED}: {e!r}" if self._group_failed(e) else repr(e)
            for request_id in list(self._active):
                self._fail(request_id, f"engine step failed: {why}", abort_engine=True)
            return True
        _charge_cpu_wait(in_engine, wait_before_s)
        for job in in_engine:  # failed inside the step (`_on_prompt_kv`): failed now that it is over
            if job.step_error is not None:
                self._fail(job.request_id, job.step_error, abort_engine=True)
        self._refresh_ep_summary()
        for out in outputs:
            if out.finish_reason == "error":  # failed alone in the engine (its sampling, or its step)
                self._fail(out.request_id, f"prefill failed: {out.error}")
            elif out.finished:
                try:
                    self._checkpoint("complete")
                    self.handover.complete(out.request_id, out.finish_reason, out.queue_s or 0.0)
                except Exception as e:  # noqa: BLE001 - fails this request only
                    self._loop_error(e, f"completing {out.request_id} failed")
                    self._fail(out.request_id, f"prefill completion failed: {e!r}", abort_engine=True)
        return True

    def _start(self, job: Job) -> None:
        try:
            self._checkpoint("start")
            if self._group_error is not None:
                raise RuntimeError(f"{self.name}: {GROUP_FAILED}: {self._group_error}")
            if job.bound:
                assert job.meta is not None
                self._sender(job).begin(job.meta)
            self.engine.add_request(
                list(job.request.prompt_token_ids),
                job.request.params,
                request_id=job.request_id,
                arrival_time_s=job.arrival_s,
                prefill_only=True,
            )
        except Exception as e:  # noqa: BLE001
            self._loop_error(e, f"starting {job.request_id} failed")
            job.error = repr(e)
            with self._lock:
                self._num_queued_tokens -= job.num_prompt_tokens
            try:
                self.engine.abort_request(job.request_id)
                self.engine.pop_finished_outputs([job.request_id])
                sender = self._sender(job)
                if job.request_id in sender.pending_request_ids():
                    sender.abort(job.request_id, job.error)
            except Exception:  # noqa: BLE001 - the caller is told either way
                logger.exception("%s: cleaning up %s failed", self.name, job.request_id)
            job.wake()
            return
        with self._lock:
            self._active[job.request_id] = job

    def _on_prompt_kv(
        self, request_id: str, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None
    ) -> None:
        job = self._active.get(request_id)
        if job is None or job.step_error is not None:
            return
        try:
            if not job.bound:  # its bind may have come during this step
                bind = self._take_bind(request_id)
                if bind is not None:
                    self.handover.begin(job, bind)
            job.layers[layer_idx] = (latent_kv, scale)
            if self.layerwise and job.bound:
                self.handover.send_computed_layers(job)
        except Exception as e:  # noqa: BLE001 - fails this job after the step, not the step's others
            job.step_error = f"handing its KV to the sender failed: {e!r}"

    def _take_bind(self, handoff_id: str) -> PrefillBind | None:
        with self._lock:
            return self._binds.pop(handoff_id, None)

    def _fail(self, request_id: str, reason: str, abort_engine: bool = False) -> None:
        """Fail one job: free its blocks, abort its handoff, wake `prefill` with the error. Never raises."""
        job = self._active.get(request_id)
        if job is None:
            return
        try:
            if abort_engine:
                self.engine.abort_request(request_id)
                self.engine.pop_finished_outputs([request_id])  # aborted: no output
            self.engine.pop_prefill_result(request_id)
            job.layers.clear()
            try:
                if job.bound:
                    self._sender(job).abort(request_id, reason)
            except ValueError:
                pass  # already finished on the sender
        except Exception:  # noqa: BLE001 - the job still fails below
            logger.exception("%s: failing %s did not clean up", self.name, request_id)
        finally:
            job.error = reason
            self._finish_job(job)

    def _finish_job(self, job: Job) -> None:
        with self._lock:
            self._active.pop(job.request_id, None)
            self._num_queued_tokens -= job.num_prompt_tokens
        job.wake()
        job.sampled.set()


def _charge_cpu_wait(jobs: list[Job], wait_before_s: float | None) -> None:
    wait_after_s = run_delay_s() if wait_before_s is not None else None
    for job in jobs:
        if wait_before_s is None or wait_after_s is None or job.cpu_wait_s is None:
            job.cpu_wait_s = None
        else:
            job.cpu_wait_s += wait_after_s - wait_before_s
