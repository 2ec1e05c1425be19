"""Elastic EP growing back (`driver.elastic`): a shrunk instance asks Ray for replacement ranks in its free
bundles; they meet the survivors (`RankWorker.grow_group`), which switch to the grown group at a step
boundary; the driver then wires their KV. Each step runs on the elastic worker (`ElasticInstances._submit`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.driver.actor_errors import describe_error
from pdcluster.driver.instance import Instance
from pdcluster.driver.messages import InstanceGroupSpec

logger = logging.getLogger("pdcluster.driver.cluster")

MAX_GROW_TRIES = 5  # growth attempts failing in a row before a shrunk instance stops growing back


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


def rendezvous_bundle(bundles: list[int] | None, num_ranks: int, survivors: Sequence[int] = (0,)) -> int:
    """The bundle hosting a re-formed group's rendezvous: its rank 0's, the first of the `survivors` (old
    rank ids; growing: rank 0 stays), over the instance's `bundles` (None: `0..num_ranks-1`)."""
    return (bundles or list(range(num_ranks)))[survivors[0]]


def unplaced_bundles(ray, placement_group: Any, bundles: Sequence[int]) -> list[int]:
    """Those of `bundles` of `placement_group` that Ray has on no live node now."""
    where = ray.util.placement_group_table(placement_group).get("bundles_to_node_id", {})
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    return [b for b in bundles if where.get(b) not in alive]


class GrowBack:
    """`ElasticInstances`' growing back: needs its `deployment`, `registry`, `growing`, `_changed_s`,
    `_given_up`, `grow_after_s`, `_set_decode_ranks`, `_reconnect_prefills`, `busy` and `_submit`."""

    def tick(self, ray) -> None:
        """Once per probe round: start replacements for shrunk instances, and follow those joining (each
        on the elastic worker, `_submit`, unless a step of that instance runs there still)."""
        for key in sorted(self._changed_s.copy()):  # the instances that shrank (changed on the worker)
            if not self.busy(key):
                self._submit(key, self._tick_one, ray, key)

    def _tick_one(self, ray, key: tuple[str, int]) -> None:
        instance = self.registry.instances[key[0]][key[1]]
        growth = self.growing.get(key)
        if growth is not None:
            self._follow(ray, instance, growth)
        elif (
            instance.degraded
            and instance.routable
            and key not in self._given_up
            and key not in self._grow_given_up
            and time.monotonic() - self._changed_s[key] >= self.grow_after_s
        ):
            self._changed_s[key] = time.monotonic()
            try:
                self._start_growth(ray, instance)
            except Exception as e:  # noqa: BLE001 - Ray could not place them now: later
                self._missed(key, instance, f"starting replacement ranks failed: {describe_error(e)}")

    def _start_growth(self, ray, instance: Instance) -> None:
        dep, key = self.deployment, (instance.role, instance.index)
        spec_index = next(i for i, s in enumerate(dep._plan.instances) if (s.role, s.index) == key)
        num_ranks, bundles = instance.deployed_ranks, instance.bundles or list(range(instance.num_ranks))
        free = [b for b in range(num_ranks) if b not in bundles]
        unplaced = unplaced_bundles(ray, dep._placement_groups[spec_index], free)
        if unplaced:  # (a grown group of fewer ranks may not split the experts: all of them, or none)
            raise RuntimeError(f"bundle(s) {unplaced} are on no live node now (Ray has not re-placed them)")
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

        attempt = next(self._attempt_ids)
        first = instance.num_ranks
        newcomers = [
            dep._new_rank_actor(ray, spec_index, first + i, spec(first + i), bundle=b)
            for i, b in enumerate(free)
        ]
        redundant = dep.topology.pool(instance.role).num_redundant_experts
        grows = [a.grow_group.remote(spec(r), redundant, attempt) for r, a in enumerate(instance.ranks)]
        ready = [a.ready.remote() for a in newcomers]
        self.growing[key] = Growth(attempt, newcomers, free, grows, ready, time.monotonic())
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
                self._missed(key, instance, f"replacement ranks did not join ({describe_error(e)})")
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

    def _missed(self, key: tuple[str, int], instance: Instance, why: str) -> None:
        """A growth attempt failed for `why`: the next one waits `grow_after_s` doubled per failure; after
        MAX_GROW_TRIES in a row the instance serves degraded until it loses a rank again."""
        misses = self._grow_misses[key] = self._grow_misses.get(key, 0) + 1
        if misses >= MAX_GROW_TRIES:
            self._grow_given_up.add(key)
            logger.error(
                "%s-%d: %s; growing back given up after %d tries in a row: it serves degraded on %d rank(s)",
                *(*key, why, misses, instance.num_ranks),
            )
            return
        self._changed_s[key] = time.monotonic() + (2 ** (misses - 1) - 1) * self.grow_after_s
        logger.error("%s-%d: %s; still degraded (try %d of %d)", *key, why, misses, MAX_GROW_TRIES)

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
        self._grow_misses.pop(key, None)
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
        with self._wiring:
            self._wire_newcomers_locked(ray, instance, growth)

    def _wire_newcomers_locked(self, ray, instance: Instance, growth: Growth) -> None:
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
