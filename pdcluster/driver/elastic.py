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
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.config import ADDRESSED_KV_TRANSPORTS
from pdcluster.driver.actor_errors import describe_error
from pdcluster.driver.elastic_budget import placement_refused
from pdcluster.driver.elastic_loss import RankLoss, confirmed_rank_loss
from pdcluster.driver.health import Health, InstanceHealth
from pdcluster.driver.instance import Instance
from pdcluster.driver.messages import InstanceGroupSpec

logger = logging.getLogger("pdcluster.driver.cluster")

MAX_SHRINK_TRIES = 3  # re-forming an instance's group fails this often before it is left out of routing
GROW_AFTER_S = 5.0  # a shrunk instance asks Ray for replacement ranks this long after its last change


@dataclass
class Growth:
    """Replacement ranks joining a shrunk instance: `attempt` id, their actors and bundles, the survivors'
    `grow_group` calls, the newcomers' `ready` calls."""

    attempt: int
    newcomers: list[Any]
    bundles: list[int]
    grows: list[Any]
    ready: list[Any]
    started_s: float
    aborted: bool = False


def elastic_ep(topology: Any, role: str) -> bool:
    """Whether pool `role`'s multi-rank instances shrink when they lose ranks: its `elastic_ep` key, and a
    KV transport wired per rank (grpc, shm, shm+grpc; torch_distributed's group is fixed at deploy)."""
    return topology.pool(role).elastic_ep and topology.kv_transport in ADDRESSED_KV_TRANSPORTS


def rendezvous_bundle(bundles: list[int] | None, num_ranks: int, survivors: Sequence[int] = (0,)) -> int:
    """The bundle hosting a re-formed group's rendezvous: its rank 0's, the first of the `survivors` (old
    rank ids; growing: rank 0 stays), over the instance's `bundles` (None: `0..num_ranks-1`)."""
    return (bundles or list(range(num_ranks)))[survivors[0]]


class ElasticInstances:
    """Shrinks instances that lost ranks. `set_decode_ranks(index, n)`: the router's rank count;
    `max_local_experts`: role -> expert slots per MoE layer a survivor may hold (`survivor_expert_slots`)."""

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
        self._attempts = 0

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
        if key in self.growing:
            self._abort_growth(ray, instance, self.growing.pop(key), "a rank was lost meanwhile")
        self._changed_s[key] = time.monotonic()
        try:
            self.shrink(ray, instance, loss, outcomes)
        except Exception as e:  # noqa: BLE001 - refused, or a survivor failed: say so, maybe try again
            refused = placement_refused(e)
            self._tries[key] = self._tries.get(key, 0) + 1
            if refused or self._tries[key] >= MAX_SHRINK_TRIES:
                self._give_up(key, loss, f"shrinking failed: {describe_error(e)}")
            else:
                logger.error("%s-%d: shrinking failed (%s); trying again at the next probe", *key, e)
        return True

    def may_shrink(self, instance: Instance) -> bool:
        """`instance` has several ranks and was not given up on (`PlacementRefused`, or failed shrinks)."""
        return instance.num_ranks >= 2 and (instance.role, instance.index) not in self._given_up

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
        results = ray.get(refs, timeout=2 * rendezvous_s + dep.call_timeout_s)
        for r in loss.lost:  # (a stalled one: its old group was given up, the new one has a new secret)
            try:
                ray.kill(instance.ranks[r], no_restart=True)
            except Exception as e:  # noqa: BLE001 - gone already
                logger.warning("%s-%d: killing lost rank %d: %r", *key, r, e)
        clients = {new: instance._clients.get(old) for new, old in enumerate(loss.survivors)}
        instance._clients = {new: c for new, c in clients.items() if c is not None}
        if instance.role == "decode":
            addresses = dep._decode_addresses[instance.index]
            dep._decode_addresses[instance.index] = [addresses[r] for r in loss.survivors]
            instance.ranks = actors
            self._fail_attempts(
                "decode", instance.index, {old: new for new, old in enumerate(loss.survivors)}
            )
            self._set_decode_ranks(instance.index, len(actors))
            self._reconnect_prefills(ray)
        else:
            instance.ranks = actors
        bundles = instance.bundles or list(range(len(outcomes)))
        instance.bundles = [bundles[r] for r in loss.survivors]
        instance.lost_ranks = instance.lost_ranks + len(loss.lost)
        instance.recoveries += 1
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

    # ---- growing back ------------------------------------------------------------------------------------
    def tick(self, ray) -> None:
        """Once per probe round: start replacements for shrunk instances, and follow those joining."""
        now_s = time.monotonic()
        for key in sorted(self._changed_s):  # the instances that shrank
            instance = self.registry.instances[key[0]][key[1]]
            growth = self.growing.get(key)
            if growth is not None:
                self._follow(ray, instance, growth)
            elif (
                instance.degraded
                and instance.routable
                and key not in self._given_up
                and now_s - self._changed_s[key] >= self.grow_after_s
            ):
                self._changed_s[key] = now_s
                try:
                    self._start_growth(ray, instance)
                except Exception as e:  # noqa: BLE001 - Ray could not place them now: later
                    logger.warning("%s-%d: starting replacement ranks failed: %r", *key, e)

    def _start_growth(self, ray, instance: Instance) -> None:
        dep, key = self.deployment, (instance.role, instance.index)
        spec_index = next(i for i, s in enumerate(dep._plan.instances) if (s.role, s.index) == key)
        num_ranks, bundles = instance.deployed_ranks, instance.bundles or list(range(instance.num_ranks))
        free = [b for b in range(num_ranks) if b not in bundles]
        init_method, barrier_port, secret = dep._rendezvous(ray, spec_index, rendezvous_bundle(bundles, 1))
        from pdcluster.driver.rank_actors import ready_timeout_s

        def spec(rank: int) -> InstanceGroupSpec:
            return InstanceGroupSpec(
                rank,
                num_ranks,
                init_method,
                barrier_port,
                dep._plan.collective_backend,
                dep.collective_timeout_s,
                ready_timeout_s(dep.topology),
                secret,
            )

        self._attempts += 1
        first = instance.num_ranks
        newcomers = [
            dep._new_rank_actor(ray, spec_index, first + i, spec(first + i), bundle=b)
            for i, b in enumerate(free)
        ]
        redundant = dep.topology.pool(instance.role).num_redundant_experts
        grows = [
            a.grow_group.remote(spec(r), redundant, self._attempts) for r, a in enumerate(instance.ranks)
        ]
        ready = [a.ready.remote() for a in newcomers]
        self.growing[key] = Growth(self._attempts, newcomers, free, grows, ready, time.monotonic())
        logger.warning("%s-%d: replacement rank(s) in bundle(s) %s are joining", *key, free)

    def _follow(self, ray, instance: Instance, growth: Growth) -> None:
        from pdcluster.driver.rank_actors import ready_timeout_s

        key = (instance.role, instance.index)
        done, _ = ray.wait(growth.grows, num_returns=len(growth.grows), timeout=0)
        if len(done) == len(growth.grows):
            del self.growing[key]
            self._changed_s[key] = time.monotonic()
            try:
                ray.get(growth.grows, timeout=0)
            except Exception as e:  # noqa: BLE001 - aborted, or a newcomer never came: it stays degraded
                self._kill(ray, growth.newcomers)
                logger.error(
                    "%s-%d: replacement ranks did not join (%s); still degraded", *key, describe_error(e)
                )
                return
            self._joined(ray, instance, growth)
            return
        if growth.aborted:
            return
        ready, _ = ray.wait(growth.ready, num_returns=len(growth.ready), timeout=0)
        why = None
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception as e:  # noqa: BLE001 - a newcomer died while joining
                why = f"a replacement rank failed while joining: {describe_error(e)}"
        if why is None and time.monotonic() - growth.started_s > ready_timeout_s(self.deployment.topology):
            why = "the replacement ranks did not join within the ready timeout"
        if why is not None:
            self._abort_growth(ray, instance, growth, why)

    def _abort_growth(self, ray, instance: Instance, growth: Growth, why: str) -> None:
        growth.aborted = True
        logger.error("%s-%d: growing aborted (%s)", instance.role, instance.index, why)
        for actor in instance.ranks:
            with contextlib.suppress(Exception):  # a dead survivor: the shrink path handles it
                actor.abort_grow.remote(growth.attempt)
        self._kill(ray, growth.newcomers)

    @staticmethod
    def _kill(ray, actors: list[Any]) -> None:
        for actor in actors:
            with contextlib.suppress(Exception):  # gone already
                ray.kill(actor, no_restart=True)

    def _joined(self, ray, instance: Instance, growth: Growth) -> None:
        """The survivors switched to the grown group: wire its newcomers (now ranks of the instance); when
        that fails, take the instance out of routing and kill them (the next probe round shrinks it)."""
        key = (instance.role, instance.index)
        instance.bundles = (instance.bundles or list(range(instance.num_ranks))) + growth.bundles
        instance.ranks = instance.ranks + growth.newcomers
        try:
            self._wire_newcomers(ray, instance, growth)
        except Exception as e:  # noqa: BLE001 - a newcomer died or did not answer: lose it
            self.registry.mark_failed(*key, e, "wiring replacement ranks")
            self._kill(ray, growth.newcomers)
            logger.error(
                "%s-%d: wiring the replacement rank(s) in bundle(s) %s failed (%s); they were killed and "
                "the instance shrinks again",
                *key,
                growth.bundles,
                describe_error(e),
            )
            return
        instance.rejoins += 1
        logger.warning(
            "%s-%d: %d replacement rank(s) joined after %.1f s; %d ranks again",
            *key,
            len(growth.newcomers),
            time.monotonic() - growth.started_s,
            instance.num_ranks,
        )

    def _wire_newcomers(self, ray, instance: Instance, growth: Growth) -> None:
        """KV wiring of `growth`'s newcomers (already ranks of `instance`): decode ones start receivers that
        prefill ranks then reach; prefill ones connect to every decode rank. Raises what a call raised."""
        from pdcluster.driver.wiring import advertised_address

        dep = self.deployment
        transport, tls, timeout_s = dep.topology.kv_transport, dep._kv_tls, dep.call_timeout_s
        if instance.role == "decode":
            addresses = ray.get(
                [a.start_receiver.remote(transport, tls) for a in growth.newcomers], timeout=timeout_s
            )
            if transport == "grpc" and not dep._loopback:
                ips = ray.get([a.node_ip.remote() for a in growth.newcomers], timeout=timeout_s)
                addresses = [advertised_address(a, ip) for a, ip in zip(addresses, ips, strict=True)]
            dep._decode_addresses[instance.index] = list(dep._decode_addresses[instance.index]) + addresses
            self._set_decode_ranks(instance.index, instance.num_ranks)
            self._reconnect_prefills(ray)
        else:
            decode_addresses = [list(ranks) for ranks in dep._decode_addresses]
            ray.get(
                [a.connect_receivers.remote(transport, decode_addresses, tls) for a in growth.newcomers],
                timeout=timeout_s,
            )
