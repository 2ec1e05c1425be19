"""Elastic expert parallelism on the driver: a multi-rank instance that lost ranks shrinks onto its survivors.

A rank is lost when it died, or stopped answering probes for its pool's `elastic_stall_s` while every rank
that answered saw the group fail or was blocked in one collective as long (`driver.elastic_loss`). The
survivors form a new group (`RankWorker.reform_group`, a new rendezvous secret), the lost actors are killed,
KV senders and the router learn the new ranks, and the instance rejoins routing. Requests with KV on a lost
rank (or in its handoff) are re-dispatched (`driver.recompute`); the survivors' roll back to the failed step
and keep their KV. When the survivors cannot hold every expert in their device's memory
(`driver.elastic_budget`; `PlacementRefused`, before any new group forms), the instance is left dead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from pdcluster.config import ADDRESSED_KV_TRANSPORTS
from pdcluster.driver.actor_errors import describe_error
from pdcluster.driver.elastic_budget import placement_refused
from pdcluster.driver.elastic_grow import GrowBack, Growth, rendezvous_bundle  # noqa: F401 - re-exported
from pdcluster.driver.elastic_loss import RankLoss, confirmed_rank_loss
from pdcluster.driver.health import Health, InstanceHealth
from pdcluster.driver.instance import Instance
from pdcluster.driver.messages import InstanceGroupSpec

logger = logging.getLogger("pdcluster.driver.cluster")

MAX_SHRINK_TRIES = 3  # re-forming an instance's group fails this often before it is left out of routing
GROW_AFTER_S = 5.0  # a shrunk instance asks Ray for replacement ranks this long after its last change
ELASTIC_WORKERS = 4  # instances shrinking or growing at once (each instance's steps run one at a time)


def elastic_ep(topology: Any, role: str) -> bool:
    """Whether pool `role`'s multi-rank instances shrink when they lose ranks: its `elastic_ep` key, and a
    KV transport wired per rank (grpc, shm, shm+grpc; torch_distributed's group is fixed at deploy)."""
    return topology.pool(role).elastic_ep and topology.kv_transport in ADDRESSED_KV_TRANSPORTS


class ElasticInstances(GrowBack):
    """Shrinks instances that lost ranks and grows them back. `set_decode_ranks(index, n)`: the router's
    rank count; `max_local_experts`: role -> expert slots per MoE layer a survivor may hold
    (`survivor_expert_slots`). Shrinking and growing run on its own worker threads (`_submit`), one step
    of an instance at a time, never on the health monitor's."""

    def __init__(
        self,
        deployment: Any,
        registry: Any,
        set_decode_ranks: Callable[[int, int], None],
        fail_attempts: Callable[..., None],
        max_local_experts: dict[str, int] | None = None,
    ) -> None:
        self.deployment = deployment
        self.registry = registry
        self._set_decode_ranks = set_decode_ranks
        self._fail_attempts = fail_attempts
        self.max_local_experts = dict(max_local_experts or {})
        self._given_up: set[tuple[str, int]] = set()
        self._tries: dict[tuple[str, int], int] = {}
        self.grow_after_s = GROW_AFTER_S
        self.growing: dict[tuple[str, int], Growth] = {}
        self._changed_s: dict[tuple[str, int], float] = {}  # each instance's last shrink or growth attempt
        self._attempt_ids = itertools.count(1)
        self._grow_misses: dict[tuple[str, int], int] = {}  # growth attempts failed in a row
        self._grow_given_up: set[tuple[str, int]] = set()  # no more growth attempts (MAX_GROW_TRIES)
        self._pool = ThreadPoolExecutor(ELASTIC_WORKERS, thread_name_prefix="elastic-ep")
        self._jobs: dict[tuple[str, int], Future] = {}  # each instance's last step on the pool
        self._wiring = threading.Lock()  # the deployment's KV addresses, changed by one step at a time

    def busy(self, key: tuple[str, int]) -> bool:
        """A step of instance `key` (shrinking, growing) is queued or running on the elastic worker."""
        job = self._jobs.get(key)
        return job is not None and not job.done()

    def _submit(self, key: tuple[str, int], fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the elastic worker as instance `key`'s next step; what it raises is logged."""

        def step() -> None:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a bug, or the cluster going away: said, the next round goes on
                logger.exception("%s-%d: an elastic EP step failed", *key)

        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._jobs[key] = self._pool.submit(step)

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every queued step ended within `timeout_s` seconds."""
        done, pending = wait(list(self._jobs.values()), timeout=timeout_s)
        return not pending

    def close(self) -> None:
        """Stop taking steps; queued ones are dropped, a running one ends on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def on_probe(
        self,
        ray,
        instance: Instance,
        outcomes: Sequence[Any],
        sent: dict[int, tuple[Any, float]] | None = None,
        found: tuple[RankLoss | None, list[Any]] | None = None,
    ) -> bool:
        """Shrink `instance` if this round shows a `RankLoss` (`found`: this round's, confirmed already;
        `sent`: re-probes of its silent ranks out already); True when it was handled (shrunk, or refused
        and logged), False when the caller's usual failure path applies."""
        key = (instance.role, instance.index)
        if not self.may_shrink(instance):
            return False
        if self.busy(key):  # re-forming (or a growth step) on the elastic worker: the next round sees
            return True
        loss, outcomes = found or self.rank_loss(ray, instance, outcomes, sent)
        if loss is None:
            if not instance.routable and all(isinstance(o, BaseException) for o in outcomes):
                self._fail_attempts(*key)  # no survivor holds the requests' KV any more
            return False
        if self.deployment.topology.kv_transport not in ADDRESSED_KV_TRANSPORTS:
            self._give_up(
                key, loss, f"kv_transfer {self.deployment.topology.kv_transport} is wired at deploy"
            )
            return True
        self._fail_attempts(instance.role, instance.index, {r: r for r in loss.survivors})
        self._submit(key, self._lose, ray, instance, loss, outcomes)
        return True

    def _lose(self, ray, instance: Instance, loss: RankLoss, outcomes: Sequence[Any]) -> None:
        """On the elastic worker: end a growth under way, then `shrink` (tried again at a later round when
        it failed, up to MAX_SHRINK_TRIES; given up at once when refused)."""
        key = (instance.role, instance.index)
        self._grow_misses.pop(key, None)
        self._grow_given_up.discard(key)
        if key in self.growing:
            self._abort_growth(ray, instance, self.growing.pop(key), "a rank was lost meanwhile")
        self._changed_s[key] = time.monotonic()
        try:
            self.shrink(ray, instance, loss, outcomes)
            self._tries.pop(key, None)  # MAX_SHRINK_TRIES counts the tries of one loss
        except Exception as e:  # noqa: BLE001 - refused, or a survivor failed: say so, maybe try again
            refused = placement_refused(e)
            self._tries[key] = self._tries.get(key, 0) + 1
            if refused or self._tries[key] >= MAX_SHRINK_TRIES:
                self._give_up(key, loss, f"shrinking failed: {describe_error(e)}")
            else:
                logger.error("%s-%d: shrinking failed (%s); trying again at the next probe", *key, e)

    def may_shrink(self, instance: Instance) -> bool:
        """`instance` has several ranks and was not given up on (`PlacementRefused`, or failed shrinks)."""
        return instance.num_ranks >= 2 and (instance.role, instance.index) not in self._given_up

    def may_detect(self, instance: Instance) -> bool:
        """`may_shrink`, and no step of `instance` runs on the elastic worker now."""
        return self.may_shrink(instance) and not self.busy((instance.role, instance.index))

    def stall_s(self, role: str) -> float:
        """Pool `role`'s `elastic_stall_s`: how long a silent rank's peers must wait in one collective."""
        return self.deployment.topology.pool(role).elastic_stall_s

    def rank_loss(
        self, ray, instance: Instance, outcomes: Sequence[Any], sent: dict | None = None
    ) -> tuple[RankLoss | None, list]:
        """`driver.elastic_loss.confirmed_rank_loss` of one probe round's `outcomes` of `instance`."""
        return confirmed_rank_loss(
            ray, instance, outcomes, self.stall_s(instance.role), self.deployment.call_timeout_s, sent
        )

    def _give_up(self, key: tuple[str, int], loss: RankLoss, why: str) -> None:
        """Leave the instance out of routing for good, dead with `why` as its /health reason; its requests
        end with that reason (the survivors' were held for the re-formed group)."""
        self._given_up.add(key)
        reason = f"lost rank(s) {list(loss.lost)} and cannot shrink onto the survivors: {why}"
        with self.registry.lock:
            instance = self.registry.instances[key[0]][key[1]]
            instance.may_recover = False
            health = instance.health
            instance.health = dataclasses.replace(
                health, state=Health.DEAD, reason=reason, since_s=time.monotonic()
            )
        self._fail_attempts(*key)
        why_lost = f"{reason} ({loss.why})"
        logger.error("%s-%d: %s: it stays out of routing, as without elastic EP", *key, why_lost)

    def shrink(self, ray, instance: Instance, loss: RankLoss, outcomes: Sequence[Any]) -> None:
        """Re-form `instance` on `loss.survivors` (renumbered 0.. in old order) and put it back in routing.
        Raises what a survivor's `reform_group` raised (`PlacementRefused` in a RayTaskError), or
        GetTimeoutError when the survivors did not re-form within their rendezvous timeout."""
        started_s = time.monotonic()
        dep, key = self.deployment, (instance.role, instance.index)
        logger.error(
            "%s-%d: lost %s (%s); re-forming it on ranks %s",
            *key,
            list(loss.lost),
            loss.why,
            list(loss.survivors),
        )
        max_slots = self.survivor_slots(instance.role)
        spec_index = next(i for i, s in enumerate(dep._plan.instances) if (s.role, s.index) == key)
        bundle = rendezvous_bundle(instance.bundles, len(instance.ranks), loss.survivors)
        init_method, barrier_port, secret = dep._rendezvous(ray, spec_index, bundle)
        timeout_s = dep.collective_timeout_s
        rendezvous_s = 2 * timeout_s + dep.call_timeout_s
        actors = [instance.ranks[r] for r in loss.survivors]
        refs = [
            actor.reform_group.remote(
                InstanceGroupSpec(
                    new_rank,
                    len(actors),
                    init_method,
                    barrier_port,
                    dep._plan.collective_backend,
                    timeout_s,
                    rendezvous_s,
                    secret,
                ),
                list(loss.lost),
                max_slots,
            )
            for new_rank, actor in enumerate(actors)
        ]
        try:
            results = ray.get(refs, timeout=2 * rendezvous_s + dep.call_timeout_s)
        except Exception:
            self._abort_reform(ray, actors, refs, secret)
            raise
        for r in loss.lost:  # (a stalled one: its old group was given up, the new one has a new secret)
            try:
                ray.kill(instance.ranks[r], no_restart=True)
            except Exception as e:  # noqa: BLE001 - gone already
                logger.warning("%s-%d: killing lost rank %d: %r", *key, r, e)
        with self._wiring:
            self._rewire_shrunk(ray, instance, loss, actors, outcomes)
        before = self.registry.instances[key[0]][key[1]].health
        leader = outcomes[loss.survivors[0]]
        after = InstanceHealth(since_s=time.monotonic(), pid=leader.pid)
        self.registry.rejoin(*key, before, after)
        logger.warning(
            "%s-%d: serving again on %d rank(s) after %.1f s (lost %s; %d expert slots per MoE layer; "
            "the lost ranks' requests were re-dispatched, the survivors' go on)",
            *key,
            len(actors),
            time.monotonic() - started_s,
            list(loss.lost),
            results[0]["num_local_experts"],
        )

    def _rewire_shrunk(
        self, ray, instance: Instance, loss: RankLoss, actors: list[Any], outcomes: Sequence[Any]
    ) -> None:
        """The re-formed `instance`'s ranks, clients, bundles and (decode) KV addresses and router ranks."""
        dep = self.deployment
        clients = {new: instance._clients.get(old) for new, old in enumerate(loss.survivors)}
        instance._clients = {new: c for new, c in clients.items() if c is not None}
        bundles = instance.bundles or list(range(len(outcomes)))
        instance.bundles = [bundles[r] for r in loss.survivors]
        instance.lost_ranks = instance.lost_ranks + len(loss.lost)
        instance.recoveries += 1
        instance.ranks = actors
        if instance.role == "decode":
            addresses = dep._decode_addresses[instance.index]
            dep._decode_addresses[instance.index] = [addresses[r] for r in loss.survivors]
            self._fail_attempts(
                "decode", instance.index, {old: new for new, old in enumerate(loss.survivors)}
            )
            self._set_decode_ranks(instance.index, len(actors))
            try:
                self._reconnect_prefills(ray)
            except Exception as e:  # noqa: BLE001 - re-formed all the same: its handoffs from that prefill fail
                logger.error("decode-%d re-formed; a prefill rank missed its ranks: %r", instance.index, e)

    def _abort_reform(self, ray, actors: list[Any], refs: list[Any], secret: Any) -> None:
        """A re-forming that failed or timed out: every survivor stops joining its group (`abort_reform`),
        awaited up to a call timeout, so a later try does not meet a stale one."""
        for actor in actors:
            with contextlib.suppress(Exception):  # a dead survivor: the next probe round sees it
                actor.abort_reform.remote(secret)
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.deployment.call_timeout_s)
        if pending:
            logger.error("%d survivor(s) still joining an aborted re-forming", len(pending))

    def survivor_slots(self, role: str) -> int:
        """`max_local_experts[role]`, derived from the topology the first time it is needed."""
        if role not in self.max_local_experts:
            from pdcluster.driver.elastic_budget import survivor_expert_slots

            self.max_local_experts[role] = survivor_expert_slots(self.deployment.topology, role)
        return self.max_local_experts[role]

    def _reconnect_prefills(self, ray) -> None:
        dep = self.deployment
        addresses = [list(ranks) for ranks in dep._decode_addresses]
        prefills = [a for p in dep.instances["prefill"] if p.routable for a in p.ranks]
        ray.get(
            [a.connect_receivers.remote(dep.topology.kv_transport, addresses, dep._kv_tls) for a in prefills],
            timeout=dep.call_timeout_s,
        )
