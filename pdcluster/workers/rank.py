"""`RankWorker`: what the prefill and decode rank actors share, written once."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

import ray
import torch

from pdcluster.driver.messages import InstanceGroupSpec
from pdcluster.engine.compiled_forward import CompileStats
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.gc_heap import freeze_gc_heap
from pdcluster.engine.grow_vote import GrowVote
from pdcluster.engine.llm import LLMEngine
from pdcluster.models.ep_dispatch import WAITS
from pdcluster.workers.rank_channel import close_driver_channel, serve_driver_channel

if TYPE_CHECKING:
    from pdcluster.driver.rank_wire import ChannelAddress

logger = logging.getLogger(__name__)

# Seconds an idle EP rank's engine thread sleeps after a step no rank had work for (EP ranks step together).
LOCKSTEP_IDLE_S = 0.002
# Seconds between the engine thread's copies of its EP figures for load snapshots (only it may read them).
EP_STATS_REFRESH_S = 1.0


def ep_summary(engine: LLMEngine) -> dict | None:
    """The rank's expert-parallel figures as plain data for its load snapshot (`LLMEngine.ep_stats`,
    `engine.expert_parallel.EPStats`): every field of the engine's figures, None without EP."""
    stats = engine.ep_stats()
    return None if stats is None else dataclasses.asdict(stats)


class RankWorker:
    """Base of `PrefillWorker` and `DecodeWorker`."""

    CHECKPOINTS: tuple[str, ...] = ()  # the named points where the rank calls `_checkpoint` (each role's)
    # The KV cache in shared memory (decode: same-host prefill writes handoffs in place, `LLMEngine`)
    SHARED_KV_CACHE = False

    def __init__(
        self, engine_config: EngineConfig, name: str, group: InstanceGroupSpec | None = None
    ) -> None:
        torch.set_num_threads(1)
        started_s = time.monotonic()
        self.name = name
        self.group_spec = group
        self.instance_group = None
        if group is not None and group.num_ranks > 1:
            from pdcluster.driver.instance_group import join_instance_group

            self.instance_group = join_instance_group(group)
        # Expert-parallel ranks step together (`engine.llm_engine.LLMEngine`'s EP contract): every rank
        # calls `engine.step()` in a loop, idle or not.
        self.lockstep = engine_config.parallel.enabled
        if self.lockstep and self.instance_group is None:
            raise ValueError(f"{name}: an expert-parallel engine needs its instance group (group=None)")
        self.engine = self._new_engine(engine_config)
        if self.instance_group is not None:  # every rank loaded before the first lockstep collective
            from pdcluster.driver.instance_group import wait_until_loaded

            wait_until_loaded(self.instance_group)
        self.load_s = time.monotonic() - started_s
        self._stopped = threading.Event()
        self._num_loop_errors = 0
        self._last_loop_error: str | None = None
        self._thread: threading.Thread | None = None
        self._engine_passes = 0  # passes of the engine loop begun (`_engine_pass`)
        self._pass_started_s: float | None = None  # time.monotonic() when the current one began
        self._group_error: str | None = None  # set once a collective of the instance group failed
        self._ep_summary: dict | None = None  # the engine's EP figures, copied by the engine thread
        self._ep_summary_at_s = 0.0
        self._aborted_grows: set[int] = set()  # `abort_grow`
        self._aborted_reforms: set[str] = set()  # `abort_reform`: the secrets of re-formings given up
        self._grow_votes: dict[int, GrowVote] = {}  # attempt: its vote, while `grow_group` runs
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            freeze_gc_heap()  # an actor process: its engine lives as long as the process

    def _new_engine(self, engine_config: EngineConfig) -> LLMEngine:
        """The rank's engine, loaded here (`workers.role_rank` hands over one already loaded instead)."""
        group = self.instance_group.group if self.lockstep else None
        return LLMEngine(engine_config, group=group, shared_kv_cache=self.SHARED_KV_CACHE)

    def compile_stats(self) -> CompileStats:
        """What `compile` did (`engine.compiled_forward.CompileStats`); counters as they stand."""
        return self.engine.compile_stats()

    # ---- engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        raise NotImplementedError

    def _start_engine_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-engine", daemon=True)
        self._thread.start()

    def serve_driver_channel(self) -> ChannelAddress:
        """`workers.rank_channel.serve_driver_channel`: this rank's one-host channel to the driver."""
        return serve_driver_channel(self, self.name)

    def _stop_engine_thread(self, timeout_s: float = 10.0) -> None:
        """Ask the engine thread to stop (`_stopped`) and wait up to `timeout_s` seconds for it."""
        close_driver_channel(self)
        self._stopped.set()
        self._wake_engine_thread()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _wake_engine_thread(self) -> None:
        """Wake an engine thread waiting for work (subclasses that wait on something set it here)."""

    @contextlib.contextmanager
    def _engine_pass(self):
        self._engine_passes += 1
        self._pass_started_s = time.monotonic()
        try:
            yield
        finally:
            self._pass_started_s = None

    def _checkpoint(self, where: str) -> None:
        """Called at each of the role's CHECKPOINTS; does nothing here. A subclass may raise or wait there
        (the tests' fault injection, tests/faults.py)."""

    def _checkpoint_armed(self) -> bool:
        """Whether a subclass wants an engine pass though there is no work (False here)."""
        return False

    # ---- loop errors ------------------------------------------------------------------------------------
    def _loop_error(self, e: BaseException, what: str) -> None:
        """Count and log (with its traceback) an exception the engine thread survived."""
        self._num_loop_errors += 1
        self._last_loop_error = f"{what}: {e!r}"
        logger.error("%s: %s", self.name, what, exc_info=e)

    def _engine_health(self) -> dict[str, object]:
        started_s = self._pass_started_s
        return {
            "engine_thread_alive": self._thread is not None and self._thread.is_alive(),
            "engine_passes": self._engine_passes,
            "engine_pass_s": 0.0 if started_s is None else time.monotonic() - started_s,
            "num_engine_errors": self._num_loop_errors,
            "last_engine_error": self._last_loop_error,
            "instance_group_error": self._group_error,
            "collective_wait_s": WAITS.blocked_s(),
            "ep": self._ep_summary,
        }

    def _refresh_ep_summary(self) -> None:
        now_s = time.monotonic()
        if self.lockstep and now_s - self._ep_summary_at_s >= EP_STATS_REFRESH_S:
            self._ep_summary = ep_summary(self.engine)
            self._ep_summary_at_s = now_s

    def _group_failed(self, e: BaseException) -> bool:
        from pdcluster.engine.elastic_ep import lost_peer
        from pdcluster.models.ep_dispatch import EPCollectiveError

        if not lost_peer(e):  # (gloo's failed collective, or an NCCL / HCCL watchdog abort)
            return False
        failure = e if isinstance(e, EPCollectiveError) or e.__cause__ is None else e.__cause__
        if self._group_error is None:
            self._group_error = str(failure)
            logger.error("%s: the instance group failed; this rank stops stepping: %s", self.name, failure)
        return True

    # ---- elastic EP (workers.elastic_rank) ----------------------------------------------------------------
    def reform_group(
        self, spec: InstanceGroupSpec, lost_ranks: list[int], max_local_experts: int | None
    ) -> dict:
        """`workers.elastic_rank.shrink`: re-form on the survivors' group `spec` after losing `lost_ranks`."""
        from pdcluster.workers.elastic_rank import shrink

        return shrink(self, spec, lost_ranks, max_local_experts)

    def abort_reform(self, secret: str) -> None:
        """End `reform_group`'s joining of the group with rendezvous `secret` (the driver gave up on it)."""
        self._aborted_reforms.add(secret)

    def grow_group(self, spec: InstanceGroupSpec, num_redundant_experts: int, attempt: int) -> dict:
        """`workers.elastic_rank.grow`: take in new ranks over group `spec`, at a step boundary."""
        from pdcluster.workers.elastic_rank import grow

        return grow(self, spec, num_redundant_experts, attempt)

    def abort_grow(self, attempt: int) -> None:
        """End `grow_group`'s wait for the new ranks of `attempt` (one of them died or never came)."""
        self._aborted_grows.add(attempt)
        vote = self._grow_votes.get(attempt)
        if vote is not None:  # withdrawn from the next step's agreement on, unless it already agreed
            vote.abort()
