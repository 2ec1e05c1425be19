"""The health monitor of a `Cluster`: instances leave routing when a call fails, rejoin when they answer.

`InstanceMonitor` (a mixin of `orchestrator.cluster.Cluster`) applies the pure health policy
(`orchestrator.health`) to the deployed instances (`orchestrator.instance.Instance`): a call on the request
path that times out or dies marks its instance (`_mark_failed`; a decode instance's in-flight requests get a
`DecodeLost` event), and a monitor thread probes every rank of every instance each PROBE_INTERVAL_S
(`_probe_all`): an instance all of whose ranks answer rejoins, after rewiring its KV transport if Ray
restarted its actor (a new process id of its leader). An instance fails and rejoins as one unit.

The probe's loads also feed the engine watchdog (`health.engine_fault`): an instance one of whose ranks
answers while its engine thread died or hangs in one pass (past the pool's `engine_watchdog_s`) is failed
as dead, and where Ray restarts its actors (`deployment.ray_restarts`) the monitor kills them for Ray to
restart; the new process is rewired and rejoins as after a crash. So is an instance that has answered no
probe for as long (`health.unresponsive_too_long`: a native call hung holding the GIL, a stopped
process), and, once per death, a restart Ray still reports as restarting after deploy's load timeout
(`health.restart_overdue`). An actor Ray gave up on (its restarts spent, or a restart whose constructor
raised: Ray does not restart those) is replaced by a new actor in its placement group bundle
(`_replace_if_given_up`: REPLACE_AFTER_S after, doubling, at most MAX_REPLACEMENTS times), which rejoins
the same way. Elsewhere the instance stays out of routing while its engine fails. Probes (and `stats()`'s
loads) run in the actors' own Ray concurrency group (`deployment.PROBE_GROUP`), so calls blocked behind a
hung engine cannot starve them; and an instance out of routing does not rejoin while a rank's pass has run
longer than a call may take (`call_timeout_s`): its calls that wait for the engine would time out again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from pdcluster.orchestrator.actor_errors import EngineFailed, describe_error
from pdcluster.orchestrator.backend import BackendUnavailable
from pdcluster.orchestrator.deployment import PROBE_GROUP, advertised_address, ray_restarts, ready_timeout_s
from pdcluster.orchestrator.dispatch import PrefillFailed
from pdcluster.orchestrator.health import (
    InstanceHealth,
    ProbeOutcome,
    after_answer,
    after_failure,
    engine_fault,
    is_stale,
    restart_overdue,
    unresponsive_too_long,
)
from pdcluster.orchestrator.instance import Instance, check_instance_group
from pdcluster.orchestrator.messages import DecodeLost, DecodeNodeLoad, PrefillNodeLoad
from pdcluster.orchestrator.request_state import Attempt
from pdcluster.orchestrator.router import RankRef
from pdcluster.orchestrator.topology import ADDRESSED_KV_TRANSPORTS, ROLES

logger = logging.getLogger("pdcluster.orchestrator.cluster")

PROBE_INTERVAL_S = 1.0  # the health monitor probes every instance this often (seconds)
# An actor Ray gave up on (its restarts spent, or its constructor raised on a restart: Ray does not restart
# an actor whose creation task failed) is replaced by a new one in its placement group bundle, at most
# MAX_REPLACEMENTS times per instance, the first REPLACE_AFTER_S seconds after it died, each next one after
# twice as long (a load that fails for good, a checkpoint deleted, is not retried every second).
REPLACE_AFTER_S = 10.0
MAX_REPLACEMENTS = 5


def rank_stats(load: PrefillNodeLoad | DecodeNodeLoad) -> dict[str, Any]:
    """One rank's load for `stats()["ranks"]`: its counters by field name (`orchestrator.messages`; decode:
    free / total KV blocks, running, reserved, waiting for a seat; prefill: queued prompt tokens,
    requests), its engine's error count and passes (`engine_passes`), and `ep`: its expert-parallel figures,
    when its engine has them."""
    fields = {f.name: getattr(load, f.name) for f in dataclasses.fields(load)}
    stats = {k: v for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool) and k != "pid"}
    if fields.get("ep") is not None:
        stats["ep"] = fields["ep"]
    return stats


class InstanceMonitor:
    """Health bookkeeping of `orchestrator.cluster.Cluster` (see the module docstring)."""

    instances: dict[str, list[Instance]]
    _stuck_passes: dict[str, tuple[int, int, float]]  # the watchdog's `stuck` per rank name (engine_fault)
    _last_answer_s: dict[tuple[str, int], float]  # time.monotonic() of each instance's last answered probe
    _engine_restarts: dict[tuple[str, int], int]  # the process last killed for Ray to restart, per instance
    _last_kill_s: dict[tuple[str, int], float]  # time.monotonic() of each instance's last such kill
    _overdue_kills: dict[tuple[str, int], float]  # the death (since_s) in which an overdue restart was killed
    _replacements: dict[tuple[str, int], int]  # new actors started for an instance Ray gave up on
    _plan: Any  # `ClusterDeployment`'s placement plan, for `_new_rank_actor` (replacements)

    @property
    def _health(self) -> dict[str, list[InstanceHealth]]:
        """Per role, each instance's health in pool order (read-only view; `_set_health` changes one)."""
        return {role: [instance.health for instance in self.instances[role]] for role in ROLES}

    def _set_health(self, role: str, index: int, health: InstanceHealth) -> None:
        self.instances[role][index].health = health

    def stats(self) -> dict[str, Any]:
        """Load snapshot of the instances in routing, and every instance's health: `ranks` (each rank's
        counters by rank name, `rank_stats`), `kv_blocks` per decode rank, the totals and `instances`.

        The snapshots are taken in parallel, waiting at most `call_timeout_s` (derived from
        kv_transfer.timeout_s, like every call on the request path): an instance that does not answer in
        time leaves routing as unresponsive (its requests fail), one whose actor died as dead; the health
        monitor brings either back once it answers again.

        Raises:
            BackendUnavailable: no prefill or no decode instance is in routing;
                the message names each instance's state and why.
        """
        import ray

        if self._closed:
            raise BackendUnavailable("the cluster is shut down")
        targets = [  # every rank of every instance in routing
            (role, instance.index, actor)
            for role in ROLES
            for instance in self.instances[role]
            if instance.routable
            for actor in instance.ranks
        ]
        sent_s = time.monotonic()
        refs = [actor.load.options(concurrency_group=PROBE_GROUP).remote() for _, _, actor in targets]
        ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout_s)
        loads: dict[str, list[Any]] = {"prefill": [], "decode": []}
        for (role, i, _), ref in zip(targets, refs, strict=True):
            try:
                load = ray.get(ref, timeout=0)
                check_instance_group([load])
                loads[role].append(load)
            except Exception as e:  # noqa: BLE001 - GetTimeoutError, an actor error, a failed group
                self._mark_failed(role, i, e, "load", sent_s)
        for role in ("prefill", "decode"):
            if not loads[role]:
                raise BackendUnavailable(f"no live {role} instance ({self._health_summary(role)})")
        prefill_loads: list[PrefillNodeLoad] = loads["prefill"]
        decode_loads: list[DecodeNodeLoad] = loads["decode"]
        return {
            "ranks": {load.name: rank_stats(load) for load in prefill_loads + decode_loads},
            "num_waiting_requests": sum(p.num_requests for p in prefill_loads),
            "num_running_requests": sum(d.num_running for d in decode_loads),
            "kv_blocks": {
                d.name: {
                    "num_used_blocks": d.num_total_blocks - d.num_free_blocks,
                    "num_total_blocks": d.num_total_blocks,
                }
                for d in decode_loads
            },
            "kv_transfer_bytes_total": self._kv_transfer_bytes_total,
            "kv_transfer_seconds_total": self._kv_transfer_seconds_total,
            "instances": self.health(),
        }

    def check_ready(self) -> None:
        """`ServingBackend.check_ready`: from the health the monitor and the request path last recorded (no
        call: a stalled instance shows here once a probe or a request's call to it timed out: within
        `PROBE_INTERVAL_S` + `call_timeout_s` of the stall, up to about twice `call_timeout_s` more when a
        probe round is already waiting on another instance).

        Raises:
            BackendUnavailable: shut down, or no prefill or no decode instance in routing; the message
                names each instance's state and why.
        """
        if self._closed:
            raise BackendUnavailable("the cluster is shut down")
        for role in ROLES:
            if not any(self._routable(role)):
                raise BackendUnavailable(f"no live {role} instance ({self._health_summary(role)})")

    def health(self) -> dict[str, dict[str, Any]]:
        """Every instance's health: `{name: {"state": "healthy" | "unresponsive" | "dead", "reason": str,
        "for_s": seconds in that state}}` (no calls made)."""
        now_s = time.monotonic()
        return {
            f"{role}-{i}": {"state": h.state.value, "reason": h.reason, "for_s": round(now_s - h.since_s, 3)}
            for role in ROLES
            for i, h in enumerate(self._health[role])
        }

    def _routable(self, role: str) -> list[bool]:
        """Per instance of pool `role`, in pool order: in routing (healthy)."""
        return [instance.routable for instance in self.instances[role]]

    _prefill_alive = property(lambda self: self._routable("prefill"))
    _decode_alive = property(lambda self: self._routable("decode"))

    def _health_summary(self, role: str) -> str:
        return "; ".join(
            f"{role}-{i} {h.state.value}" + (f": {h.reason}" if h.reason else "")
            for i, h in enumerate(self._health[role])
        )

    @staticmethod
    def _outcome(exc: BaseException) -> ProbeOutcome:
        import ray

        if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ray.exceptions.GetTimeoutError)):
            return ProbeOutcome.TIMED_OUT
        return ProbeOutcome.DIED

    @classmethod
    def _restart_pending(cls, exc: BaseException) -> bool:
        """Whether a failed call says nothing of the actor's death: it timed out (Ray queues a call to an
        actor being created), or Ray answered ActorUnavailableError ("the actor is restarting"; also while
        its node is unreachable, or when its process died with the call out). Ray answers a call to an
        actor it has given up on with ActorDiedError. For a probe: Ray may still bring the actor back."""
        import ray

        return cls._outcome(exc) is ProbeOutcome.TIMED_OUT or isinstance(
            exc, ray.exceptions.ActorUnavailableError
        )

    def _mark_failed(
        self, role: str, index: int, exc: BaseException, call: str, issued_at_s: float | None = None
    ) -> None:
        """A call `call` on instance (`role`, `index`) timed out or raised an actor error: take it out of
        routing (unresponsive or dead) and, for decode, fail its in-flight requests. Idempotent. The
        timeout of a call issued (`issued_at_s`, time.monotonic()) before the instance last rejoined routing
        changes nothing (`health.is_stale`): logged, ignored; so does Ray's "unavailable" (the actor was
        restarting or unreachable, or its process died, while the call was out: a probe answered since, and
        a process that died after that answer is found by the next probe, which is never stale)."""
        if self._outcome(exc) is ProbeOutcome.TIMED_OUT:
            reason = f"{call}: no answer within {self.call_timeout_s:g} s"
        else:
            reason = f"{call}: {describe_error(exc)}"
        with self._health_lock:
            before = self._health[role][index]
            # Not an error saying the actor died: that may come from a process that died after the probe
            # that brought it back answered.
            if self._restart_pending(exc) and is_stale(before, issued_at_s):
                assert issued_at_s is not None
                logger.warning(
                    "%s-%d: ignored a failed call (%s) sent %.2f s before the instance rejoined routing",
                    role,
                    index,
                    reason,
                    before.since_s - issued_at_s,
                )
                return
            after = after_failure(before, self._outcome(exc), reason, time.monotonic())
            self._set_health(role, index, after)
        if role == "decode":
            self._loads.forget_decode(index)
        if after is before:
            return
        logger.error("%s-%d is %s (%s); taken out of routing", role, index, after.state.value, reason)
        self._fail_attempts(role, index)

    def _monitor_health(self) -> None:
        """Health monitor thread: every PROBE_INTERVAL_S, probe every instance with one `load` call (all
        at once, waiting `call_timeout_s`). One that does not answer leaves routing, so a crash or stall is
        noticed with no request in flight; one out of routing that answers rejoins, after rewiring its KV
        transport if Ray restarted it (a new process id)."""
        while not self._monitor_stop.wait(PROBE_INTERVAL_S):
            try:
                self._probe_all()
            except Exception:  # noqa: BLE001 - Ray going away under a shutdown, or a bug: never die silently
                if self._closed:
                    return
                logger.exception("health monitor: a probe round failed; trying again")

    def _probe_all(self) -> None:
        """One round of the health monitor (see `_monitor_health`)."""
        import ray

        targets = [instance for role in ROLES for instance in self.instances[role]]
        if not targets or self._closed:
            return
        refs = [
            [actor.load.options(concurrency_group=PROBE_GROUP).remote() for actor in instance.ranks]
            for instance in targets
        ]
        flat = [ref for rank_refs in refs for ref in rank_refs]
        ray.wait(flat, num_returns=len(flat), timeout=self.call_timeout_s)
        for instance, rank_refs in zip(targets, refs, strict=True):
            if self._closed:
                return
            try:
                loads = [ray.get(ref, timeout=0) for ref in rank_refs]
                check_instance_group(loads)
                self._check_engines(instance, loads)
                pids = [load.pid for load in loads]
            except Exception as e:  # noqa: BLE001 - a rank stalled, restarting, dead, its group or engine failed
                self._mark_failed(instance.role, instance.index, e, "probe")
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
                elif self._restart_pending(e) and not self._closed:
                    # Once per DEAD episode: a restart that hangs again would hang the same way (a file
                    # system still not answering), and a node that is away would cost one restart of the
                    # actor's 5 each time, so that a long outage would leave it dead for good.
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
                for rank, load in enumerate(loads):  # the router's view, refreshed (orchestrator.load_board)
                    self._loads.update_decode(RankRef(instance.index, rank), load)
            health = instance.health
            if not health.routable or health.pid != pids[0]:
                # Not back while a pass runs longer than a call may take: the calls that wait for its
                # engine (decode's reserves, prefill's queued prefills) would time out again, and it would
                # leave routing again.
                in_long_pass = max(load.engine_pass_s for load in loads) > self.call_timeout_s
                if health.pid != pids[0] or not in_long_pass:
                    self._rejoin(instance.role, instance.index, pids[0])

    def _replace_if_given_up(self, ray, instance: Instance, exc: BaseException) -> None:
        """A probe of `instance` failed with ActorDiedError: Ray has given up on its actor (a call to an actor
        it restarts fails as unavailable; a call in flight when its process died, too), except where the
        error says the actor's node was preempted (Ray then fails calls as died while it restarts the actor
        elsewhere). Where Ray restarts actors (one rank, an addressed KV transport), replace it once due
        (REPLACE_AFTER_S after the death, or after the previous replacement twice as long as before; at
        most MAX_REPLACEMENTS for the life of the deployment): kill the old one for good (so that a restart
        Ray might still make cannot hold the bundle) and create a new one in its bundle; the probe that the
        new process answers rewires it and puts it back in routing, as after a restart. Elsewhere the
        instance stays out of routing, as before."""
        key = (instance.role, instance.index)
        restarts = ray_restarts(self.topology.kv_transport, len(instance.ranks))
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
            spec_index = next(
                i for i, spec in enumerate(self._plan.instances) if (spec.role, spec.index) == key
            )
            instance.ranks = [self._new_rank_actor(ray, spec_index, 0)]
        except Exception as e:  # noqa: BLE001 - Ray could not be asked now: the next probe tries again
            logger.warning("%s-%d: replacing its actor failed (%r); trying again at the next probe", *key, e)
            return
        self._replacements[key] = done + 1
        self._last_kill_s[key] = now_s

    def _check_engines(self, instance: Instance, loads: list[PrefillNodeLoad] | list[DecodeNodeLoad]) -> None:
        """The engine watchdog over one instance's probe answers (`health.engine_fault`). Raises
        EngineFailed naming the rank whose engine most likely failed (a dead engine thread first, else the
        longest confirmed pass: in lockstep the other ranks mostly wait for it in their collectives)."""
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
        """Instance `instance`, whose leader (rank 0) runs in process `pid`, failed the engine watchdog
        (`why`: its engine failed, or it answered nothing past the watchdog): kill its actors for Ray to
        restart them (once per process; each restart is one of the actor's MAX_ACTOR_RESTARTS), where Ray
        restarts them; else it stays out of routing until it answers with a passing engine (for good if
        its engine thread died). A kill that fails is tried again at the next probe. `again`: the restart
        of the process last seen (`pid`) is overdue (`health.restart_overdue`): the incarnation being
        started, which never answered, is killed even though `pid` was killed before. Returns whether
        it killed."""
        key = (instance.role, instance.index)
        restarts = ray_restarts(self.topology.kv_transport, len(instance.ranks))
        if self._engine_restarts.get(key) == pid and not (again and restarts):
            return False
        if not restarts:
            self._engine_restarts[key] = pid
            logger.error(
                "%s-%d: %s, but Ray does not restart its actors (kv_transfer %s, %d ranks): it stays out "
                "of routing until it answers with a passing engine",
                instance.role,
                instance.index,
                why,
                self.topology.kv_transport,
                len(instance.ranks),
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
        """Instance (`role`, `index`) out of routing (or restarted) answered a probe from process `pid`:
        rewire it if Ray restarted it, then put it back in routing. The rewiring makes Ray calls (seconds),
        during which the request path may record a failure of the instance (an actor-died error, say); the
        health is set only if nobody changed it meanwhile (compare and set under the lock), else the failure
        stands and the next probe decides."""
        import ray

        with self._health_lock:
            before = self._health[role][index]
        after, needs_rewire = after_answer(before, pid, time.monotonic())
        if needs_rewire and role == "decode":  # what ran on the old process is gone
            self._fail_decode_attempts(index)
        if self.topology.kv_transport in ADDRESSED_KV_TRANSPORTS and (needs_rewire or role == "prefill"):
            try:
                self._rewire(ray, role, index, needs_rewire)
            except Exception as e:  # noqa: BLE001 - try again at the next probe
                logger.error("%s-%d answers again but could not be rewired: %s", role, index, e)
                return
        if needs_rewire:  # a new process: its events number from 1 again, its commands start a new stream
            for client in self.instances[role][index].clients:
                client.restarted()
        with self._health_lock:
            now = self._health[role][index]
            if now is not before:  # the request path recorded a failure meanwhile (its calls, not ours)
                logger.warning(
                    "%s-%d answered a probe but became %s (%s) while it rejoined; the next probe decides",
                    role,
                    index,
                    now.state.value,
                    now.reason,
                )
                return
            self._set_health(role, index, after)
        logger.warning(
            "%s-%d rejoined routing after %.1f s %s (%s)",
            role,
            index,
            after.since_s - before.since_s,
            before.state.value,
            "restarted and rewired" if needs_rewire else "answering again",
        )

    def _rewire(self, ray, role: str, index: int, restarted: bool) -> None:
        """gRPC, shm and shm+grpc only (restarts are off for torch.distributed and for multi-rank instances,
        whose groups are fixed at deploy). A restarted decode starts its receiver on a new port (shm: a new
        socket path; shm+grpc: both, in a new `PairedAddress`), which the prefill ranks in routing learn at
        once (the others when they rejoin); a rejoining prefill instance's ranks (re)connect to every decode
        rank's current address, in case one moved meanwhile."""
        if role == "decode":
            assert restarted
            decode = self.decode_actors[index]
            transport = self.topology.kv_transport
            address = ray.get(
                decode.start_receiver.remote(transport, self._kv_tls), timeout=self.call_timeout_s
            )
            if transport == "grpc" and not self._loopback:
                address = advertised_address(
                    address, ray.get(decode.node_ip.remote(), timeout=self.call_timeout_s)
                )
            self._decode_addresses[index][0] = address
            prefills = [a for p in self.instances["prefill"] if p.routable for a in p.ranks]
            ray.get(
                [p.set_decode_address.remote(index, address) for p in prefills], timeout=self.call_timeout_s
            )
        else:
            addresses = [list(ranks) for ranks in self._decode_addresses]
            ranks = self.instances["prefill"][index].ranks
            transport = self.topology.kv_transport
            ray.get(
                [a.connect_receivers.remote(transport, addresses, self._kv_tls) for a in ranks],
                timeout=self.call_timeout_s,
            )

    def _fail_attempts(self, role: str, index: int) -> None:
        """End every in-flight attempt on instance (`role`, `index`) with a "decode_lost" event (decode)
        or a failed prefill (prefill: the dispatch policy re-dispatches it or fails it, as when its
        prefill call fails; the call is not waited for). Safe from any thread: off the requests' event
        loop (the health monitor, stats() in a worker thread) it is handed to that loop, since asyncio
        queues are not thread-safe."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(
                        self._fail_attempts_on_loop, role, index, self._why(role, index)
                    )
                return
        self._fail_attempts_on_loop(role, index, self._why(role, index))

    def _why(self, role: str, index: int) -> str:
        """Why instance (`role`, `index`) left routing, as its health says now."""
        instances = self.instances[role]  # empty once shut down
        return (
            instances[index].health.reason if index < len(instances) else "the cluster shut down"
        ) or "unknown"

    def _fail_decode_attempts(self, decode_index: int) -> None:
        """`_fail_attempts("decode", decode_index)`."""
        self._fail_attempts("decode", decode_index)

    def _fail_attempts_on_loop(self, role: str, index: int, reason: str) -> None:
        """On the requests' event loop: `_fail_attempts`, with `reason` as the instance's health gave it
        when the failure was seen (the call can run after the instance rejoined, or the cluster shut
        down)."""
        for attempt in list(self._by_handoff.values()):
            if role == "decode" and attempt.decode_index == index:
                message = f"decode-{index} died or stopped answering ({reason}); the request was lost"
                event: object = DecodeLost(attempt.handoff_id, message)
            elif role == "prefill" and attempt.prefill_index == index and _prefill_pending(attempt):
                event = PrefillFailed(f"died or stopped answering ({reason})")
            else:
                continue
            with contextlib.suppress(RuntimeError):  # a queue of another (closed) event loop
                attempt.events.put_nowait(event)


def _prefill_pending(attempt: Attempt) -> bool:
    """The attempt's prefill call was sent and has not returned (a prefill lost after that took nothing of
    the attempt with it: its KV was handed to the sender, decode reports the rest)."""
    call = attempt.prefill_call
    return call is not None and not call.done() and not attempt.prefill_reported
