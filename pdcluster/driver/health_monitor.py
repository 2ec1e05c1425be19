"""The health monitor of a `Cluster`: instances leave routing when a call fails, rejoin when they answer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pdcluster.config import ADDRESSED_KV_TRANSPORTS, ROLES
from pdcluster.driver.actor_errors import EngineFailed, describe_error
from pdcluster.driver.elastic import ElasticInstances
from pdcluster.driver.elastic_loss import probe_silent
from pdcluster.driver.health import (
    after_answer,
    engine_fault,
    restart_overdue,
    unresponsive_too_long,
)
from pdcluster.driver.instance import Instance, check_instance_group
from pdcluster.driver.load_board import LoadBoard
from pdcluster.driver.messages import DecodeNodeLoad, PrefillNodeLoad
from pdcluster.driver.periodic import PeriodicThread
from pdcluster.driver.rank_actors import PROBE_GROUP, ray_restarts, ready_timeout_s
from pdcluster.driver.registry import InstanceRegistry, restart_pending
from pdcluster.driver.router import RankRef

logger = logging.getLogger("pdcluster.driver.cluster")

PROBE_INTERVAL_S = 1.0  # the health monitor probes every instance this often (seconds)
# A dead actor is replaced in its bundle at most MAX_REPLACEMENTS times, after REPLACE_AFTER_S, doubling.
REPLACE_AFTER_S = 10.0
MAX_REPLACEMENTS = 5


class HealthMonitor(PeriodicThread):
    """The monitor thread (see the module docstring): a probe round every PROBE_INTERVAL_S."""

    thread_name = "health-monitor"

    def __init__(
        self,
        registry: InstanceRegistry,
        deployment: Any,
        loads: LoadBoard,
        fail_attempts: Callable[..., None],
    ) -> None:
        super().__init__(PROBE_INTERVAL_S)
        self.registry = registry
        self.deployment = deployment
        self.topology = deployment.topology
        self.call_timeout_s = deployment.call_timeout_s
        self._loads = loads
        self._fail_attempts = fail_attempts
        self._stuck_passes: dict[str, tuple[int, int, float]] = {}  # the watchdog's `stuck` per rank name
        self._last_answer_s: dict[tuple[str, int], float] = {}  # each instance's last answered probe
        self._engine_restarts: dict[tuple[str, int], int | None] = {}  # the process last killed, per instance
        self._last_kill_s: dict[tuple[str, int], float] = {}  # each instance's last such kill
        self._overdue_kills: dict[tuple[str, int], float] = {}  # the death an overdue restart was killed in
        self._replacements: dict[tuple[str, int], int] = {}  # actors started for one Ray gave up on
        self._losses: dict[tuple[str, int], tuple[Any, list]] = {}  # this round's confirmed rank losses
        self.elastic = ElasticInstances(
            deployment, registry, lambda index, n: loads.set_decode_ranks(index, n), fail_attempts
        )

    def stop(self, join_timeout_s: float) -> None:
        """Stop after the round in progress, and the elastic worker (`ElasticInstances.close`)."""
        super().stop(join_timeout_s)
        self.elastic.close()

    @property
    def instances(self) -> dict[str, list[Instance]]:
        return self.registry.instances

    def run_round(self) -> None:
        """One round of the health monitor, then elastic EP's growth (`tick`)."""
        import ray

        self._probe_round(ray)
        if not self._closed:
            self.elastic.tick(ray)

    def _probe_round(self, ray) -> None:

        targets = [i for role in ROLES for i in self.instances[role] if i.pool_state != "away"]
        if not targets or self._closed:
            return
        probed = [instance.ranks for instance in targets]  # (a new list once re-formed or grown)
        refs = [
            [actor.load.options(concurrency_group=PROBE_GROUP).remote() for actor in ranks]
            for ranks in probed
        ]
        flat = [ref for rank_refs in refs for ref in rank_refs]
        started_s = time.monotonic()
        stall_times = self._stall_times(targets)
        first_s = min([self.call_timeout_s, *stall_times])
        # elastic instances: a silent rank's re-probe (driver.elastic_loss) goes out halfway through
        ray.wait(flat, num_returns=len(flat), timeout=first_s / 2 if stall_times else first_s)
        sent = {
            (i.role, i.index): probe_silent(ray, i, _outcomes(ray, rank_refs))
            for i, rank_refs in zip(targets, refs, strict=True)
            if stall_times and self._elastic(i) and self.elastic.may_detect(i)
        }
        ray.wait(flat, num_returns=len(flat), timeout=max(0.0, first_s - (time.monotonic() - started_s)))
        self._losses = {}
        rest = [
            ref
            for instance, rank_refs in zip(targets, refs, strict=True)
            if not self._stalled(ray, instance, rank_refs, sent.get((instance.role, instance.index)))
            for ref in rank_refs
        ]
        left_s = self.call_timeout_s - (time.monotonic() - started_s)
        if rest and left_s > 0:
            ray.wait(rest, num_returns=len(rest), timeout=left_s)
        for instance, ranks, rank_refs in zip(targets, probed, refs, strict=True):
            if self._closed:
                return
            if instance.pool_state == "away":  # moved to the other pool during the round (driver.role_moves)
                continue
            if instance.ranks is not ranks:  # re-formed or grown meanwhile (driver.elastic): the next round
                continue
            try:
                loads = [ray.get(ref, timeout=0) for ref in rank_refs]
                check_instance_group(loads)
                self._check_engines(instance, loads)
                pids = [load.pid for load in loads]
            except Exception as e:  # noqa: BLE001 - a rank stalled, restarting, dead, its group or engine failed
                self.registry.mark_failed(instance.role, instance.index, e, "probe")
                if self._shrunk(ray, instance, rank_refs, sent.get((instance.role, instance.index))):
                    continue
                if isinstance(e, ray.exceptions.ActorDiedError) and not self._closed:
                    self._replace_if_given_up(ray, instance, e)
                    continue
                if isinstance(e, EngineFailed):
                    if not self._closed:
                        self._restart_failed_engine(ray, instance, e.pid)
                    continue
                # unanswered: a pause counts in no watchdog sighting (the next answer starts afresh)
                for rank in range(len(instance.ranks)):
                    self._stuck_passes.pop(instance.rank_name(rank), None)
                key, now_s = (instance.role, instance.index), time.monotonic()
                last_answer_s = self._last_answer_s.get(key, 0.0)
                silent = unresponsive_too_long(
                    instance.health,
                    self.topology.pool(instance.role).engine_watchdog_s,
                    now_s,
                    last_answer_s,
                    min_silent_s=2 * (self.call_timeout_s + PROBE_INTERVAL_S),
                )
                if silent is not None and not self._closed:
                    self._restart_failed_engine(ray, instance, instance.health.pid, silent)
                elif restart_pending(e) and not self._closed:
                    episode_s = instance.health.since_s
                    overdue = restart_overdue(
                        instance.health,
                        ready_timeout_s(self.topology),
                        now_s,
                        max(last_answer_s, self._last_kill_s.get(key, 0.0)),
                    )
                    if overdue is not None and self._overdue_kills.get(key) != episode_s:
                        if self._restart_failed_engine(
                            ray, instance, instance.health.pid, overdue, again=True
                        ):
                            self._overdue_kills[key] = episode_s
                            logger.warning(
                                "%s-%d: if this restart hangs too, it is not killed again: it stays out of "
                                "routing until it answers",
                                *key,
                            )
                continue
            self._last_answer_s[(instance.role, instance.index)] = time.monotonic()
            if instance.role == "decode" and instance.routable and instance.health.pid == pids[0]:
                for rank, load in enumerate(loads):  # the router's view, refreshed (driver.load_board)
                    self._loads.update_decode(RankRef(instance.index, rank), load)
            health = instance.health
            if not health.routable or health.pid != pids[0]:
                in_long_pass = max(load.engine_pass_s for load in loads) > self.call_timeout_s
                if health.pid != pids[0] or not in_long_pass:
                    self._rejoin(instance.role, instance.index, pids[0])

    def _elastic(self, instance: Instance) -> bool:
        return len(instance.ranks) >= 2 and self.topology.pool(instance.role).elastic_ep

    def _stall_times(self, targets: list[Instance]) -> list[float]:
        """The `elastic_stall_s` of each elastic multi-rank instance probed: the round's first wait."""
        return [self.elastic.stall_s(i.role) for i in targets if self._elastic(i)]

    def _stalled(self, ray, instance: Instance, rank_refs: list[Any], sent: dict | None) -> bool:
        """After the round's first wait: an elastic instance's silent rank is lost (`driver.elastic_loss`;
        `sent`: its re-probes already out), so the round need not wait the call timeout for it."""
        if self._closed or not self._elastic(instance) or not self.elastic.may_detect(instance):
            return False
        ready, _ = ray.wait(rank_refs, num_returns=len(rank_refs), timeout=0)
        if len(ready) == len(rank_refs):
            return False
        found = self.elastic.rank_loss(ray, instance, _outcomes(ray, rank_refs), sent)
        if found[0] is not None:
            self._losses[(instance.role, instance.index)] = found
        return found[0] is not None

    def _shrunk(self, ray, instance: Instance, rank_refs: list[Any], sent: dict | None) -> bool:
        """Whether elastic EP took over a multi-rank instance that lost ranks (`driver.elastic`)."""
        if self._closed or not self._elastic(instance):
            return False
        found = self._losses.pop((instance.role, instance.index), None)
        return self.elastic.on_probe(ray, instance, _outcomes(ray, rank_refs), sent, found)

    def _replace_if_given_up(self, ray, instance: Instance, exc: BaseException) -> None:
        key = (instance.role, instance.index)
        restarts = ray_restarts(self.topology.kv_transport, instance.num_deployed_ranks)
        if getattr(exc, "preempted", False) or not restarts:
            return
        done = self._replacements.get(key, 0)
        if done >= MAX_REPLACEMENTS:
            if done == MAX_REPLACEMENTS:  # said once
                self._replacements[key] = done + 1
                logger.error(
                    "%s-%d: Ray gave up on its actor again and its %d replacements are spent: it stays "
                    "out of routing (%s)",
                    *key,
                    MAX_REPLACEMENTS,
                    describe_error(exc),
                )
            return
        now_s = time.monotonic()
        since_s = max(instance.health.since_s, self._last_kill_s.get(key, 0.0))
        if now_s - since_s < REPLACE_AFTER_S * 2**done:
            return
        plan = self.deployment._plan.instances
        spec_index = next((i for i, spec in enumerate(plan) if (spec.role, spec.index) == key), None)
        if spec_index is None or (instance.home and instance.home != instance.name):
            # a slot a role move made (driver.role_moves): its actor was deployed for another slot
            self._replacements[key] = MAX_REPLACEMENTS + 1  # said once
            logger.error(
                "%s-%d (deployed as %s): Ray gave up on its actor; a moved instance is not replaced: it "
                "stays out of routing (%s)",
                *key,
                instance.home or instance.name,
                describe_error(exc),
            )
            return
        logger.error(
            "%s-%d: Ray gave up on its actor (%s); starting a new one in its placement group (%d of %d)",
            *key,
            describe_error(exc),
            done + 1,
            MAX_REPLACEMENTS,
        )
        try:
            for actor in instance.ranks:
                ray.kill(actor, no_restart=True)
            instance.ranks = [self.deployment._new_rank_actor(ray, spec_index, 0)]
        except Exception as e:  # noqa: BLE001 - Ray could not be asked now: the next probe tries again
            logger.warning("%s-%d: replacing its actor failed (%r); trying again at the next probe", *key, e)
            return
        self._replacements[key] = done + 1
        self._last_kill_s[key] = now_s

    def _check_engines(self, instance: Instance, loads: list[PrefillNodeLoad] | list[DecodeNodeLoad]) -> None:
        """Engine watchdog over one instance's probe answers; raises EngineFailed naming the failed rank."""
        watchdog_s, now_s = self.topology.pool(instance.role).engine_watchdog_s, time.monotonic()
        faults = []
        for load in loads:
            fault, stuck = engine_fault(load, watchdog_s, self._stuck_passes.get(load.name), now_s)
            if stuck is None:
                self._stuck_passes.pop(load.name, None)
            else:
                self._stuck_passes[load.name] = stuck
            if fault is not None:
                faults.append((load.engine_thread_alive, -load.engine_pass_s, fault))
        if faults:
            raise EngineFailed(min(faults)[2], loads[0].pid)

    def _restart_failed_engine(
        self, ray, instance: Instance, pid: int | None, why: str = "its engine failed", again: bool = False
    ) -> bool:
        key = (instance.role, instance.index)
        restarts = ray_restarts(self.topology.kv_transport, instance.num_deployed_ranks)
        if self._engine_restarts.get(key) == pid and not (again and restarts):
            return False
        if not restarts:
            self._engine_restarts[key] = pid
            logger.error(
                "%s-%d: %s, but Ray does not restart its actors (kv_transfer %s, %d ranks deployed): it "
                "stays out of routing until it answers with a passing engine",
                instance.role,
                instance.index,
                why,
                self.topology.kv_transport,
                instance.num_deployed_ranks,
            )
            return False
        logger.error("%s-%d: killing its actor for Ray to restart it (%s)", *key, why)
        try:
            for actor in instance.ranks:
                ray.kill(actor, no_restart=False)
        except Exception as e:  # noqa: BLE001 - Ray could not be asked now: the next probe tries again
            logger.warning("%s-%d: killing its actor failed (%r); trying again at the next probe", *key, e)
            return False
        self._engine_restarts[key] = pid
        self._last_kill_s[key] = time.monotonic()
        return True

    def _rejoin(self, role: str, index: int, pid: int) -> None:
        import ray

        before = self.instances[role][index].health
        after, needs_rewire = after_answer(before, pid, time.monotonic())
        if needs_rewire and role == "decode":  # what ran on the old process is gone
            self._fail_attempts("decode", index)
        if self.topology.kv_transport in ADDRESSED_KV_TRANSPORTS and (needs_rewire or role == "prefill"):
            try:
                self.deployment.rewire(ray, role, index, needs_rewire)
            except Exception as e:  # noqa: BLE001 - try again at the next probe
                logger.error("%s-%d answers again but could not be rewired: %s", role, index, e)
                return
        if needs_rewire:  # a new process: its events number from 1 again, its commands start a new stream
            for client in self.instances[role][index].clients:
                client.restarted()
        now = self.registry.rejoin(role, index, before, after)
        if now is not after:  # the request path recorded a failure meanwhile (its calls, not ours)
            logger.warning(
                "%s-%d answered a probe but became %s (%s) while it rejoined; the next probe decides",
                role,
                index,
                now.state.value,
                now.reason,
            )
            return
        logger.warning(
            "%s-%d rejoined routing after %.1f s %s (%s)",
            role,
            index,
            after.since_s - before.since_s,
            before.state.value,
            "restarted and rewired" if needs_rewire else "answering again",
        )


def _outcomes(ray, rank_refs: list[Any]) -> list[Any]:
    """Each rank's probe answer, or the exception it ended with (died, timed out, unavailable) by now."""
    outcomes: list[Any] = []
    for ref in rank_refs:
        try:
            outcomes.append(ray.get(ref, timeout=0))
        except Exception as e:  # noqa: BLE001 - this rank's outcome
            outcomes.append(e)
    return outcomes
