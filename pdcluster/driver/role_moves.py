"""Moving a single-device instance between the prefill and decode pools while serving (dynamic P:D): its
slot drains (out of routing; queue or running requests finished within `drain_timeout_s`), its actor
switches role in place (`RoleWorker.switch_role`), prefill ranks are re-connected to the decode receivers,
its slot in the other pool becomes active. Parking drains it the same way and leaves it loaded, out of
routing, until moved back to a role."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from typing import Any

from pdcluster.config import Topology
from pdcluster.driver.actor_errors import describe_error
from pdcluster.driver.health import InstanceHealth
from pdcluster.driver.instance import Instance
from pdcluster.driver.router import RankRef

logger = logging.getLogger("pdcluster.driver.cluster")

ROLES = ("prefill", "decode")
PARKED = "parked"
DRAIN_POLL_S = 0.05
REWIRE_ATTEMPTS = 3  # each bounded by the call timeout
# engine arguments the two roles may differ in and still share one engine (the deploy role's stand)
ROLE_FREE_FIELDS = frozenset({"compile", "max_num_seqs", "max_num_batched_tokens"})


class MoveRefused(ValueError):
    """A move that would break a rule (a pool left empty, a shape that does not fit): nothing changed."""


class MoveFailed(RuntimeError):
    """A move that began and could not end (drain bound passed, the actor died); what became of X is said."""


def movable_issue(topology: Topology) -> str | None:
    """Why this topology's instances cannot change role in place (None: they can, as `RoleWorker`s)."""
    if not topology.autoscale.enabled:
        return "autoscale.enabled is off: the rank actors are fixed-role"
    if topology.prefill.devices_per_instance != 1 or topology.decode.devices_per_instance != 1:
        return "only single-device instances move in place (re-forming a shape is elastic EP's)"
    if topology.kv_transport not in ("grpc", "shm", "shm+grpc"):
        return f"kv transport {topology.kv_transport}: its process group is fixed at deploy"
    configs = [dataclasses.asdict(topology.engine_config(role)) for role in ROLES]
    differ = sorted(k for k in configs[0] if k not in ROLE_FREE_FIELDS and configs[0][k] != configs[1][k])
    if differ:
        return f"the pools' engines differ in {', '.join(differ)}: one engine cannot serve both"
    return None


class RoleMover:
    """Executes moves on a deployed `Cluster` (one at a time); counts them for `/metrics`."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.topology: Topology = cluster.topology
        self.issue = movable_issue(self.topology)
        self.drain_timeout_s = self.topology.autoscale.drain_timeout_s
        self._lock = threading.Lock()
        self.moves: Counter[tuple[str, str, str]] = Counter()  # (from, to, trigger) -> moves done
        self.failed: Counter[tuple[str, str, str]] = Counter()
        self.last_move_s: dict[str, float] = {}  # home name -> when its last move ended
        self.moving: str | None = None  # home name of the instance moving now
        for role in ROLES:
            for slot in self.instances[role]:
                slot.home = slot.home or slot.name

    @property
    def instances(self) -> dict[str, list[Instance]]:
        return self.cluster.instances

    def find(self, name: str) -> Instance:
        """The live slot of `name` (its name now, `decode-2`, or its deploy name). Raises KeyError."""
        for role in ROLES:
            for slot in self.instances[role]:
                if slot.pool_state != "away" and name in (slot.name, slot.home):
                    return slot
        raise KeyError(f"no instance {name!r} (instances: {', '.join(self.roles())})")

    def roles(self) -> dict[str, str]:
        """Deploy name -> current role (or `parked`), for every instance in a pool (`/metrics`)."""
        return {
            s.home or s.name: PARKED if s.pool_state == PARKED else s.role
            for r in ROLES
            for s in self.instances[r]
            if s.pool_state != "away"
        }

    def check(self, source: Instance, target: str) -> None:
        """Raise `MoveRefused` naming the rule a move of `source` to pool `target` would break."""
        if self.issue is not None:
            raise MoveRefused(f"{source.name} cannot move: {self.issue}")
        if target not in (*ROLES, PARKED):
            raise MoveRefused(f"role must be prefill, decode or parked, got {target!r}")
        if self.moving is not None:
            raise MoveRefused(f"{self.moving} is moving now: one move at a time")
        if source.pool_state == PARKED and target == source.role:
            return  # unparking: it rejoins its pool
        if source.pool_state == PARKED and target == PARKED:
            raise MoveRefused(f"{source.name} is already parked")
        if source.role == target:
            raise MoveRefused(f"{source.name} is already a {target} instance")
        if source.num_ranks != 1:
            raise MoveRefused(
                f"{source.name} has {source.num_ranks} ranks: only single-device instances move"
            )
        if not source.accepting and source.pool_state != PARKED:
            raise MoveRefused(
                f"{source.name} is {source.health.state.value} ({source.pool_state}): not moved"
            )
        left = [s for s in self.instances[source.role] if s.accepting and s is not source]
        if not left and source.pool_state != PARKED:
            raise MoveRefused(f"moving {source.name} would leave the {source.role} pool empty")

    def move(self, name: str, target: str, reason: str, trigger: str = "manual") -> dict[str, Any]:
        """Move instance `name` to pool `target`, or park it (`parked`; moved to its own role a parked one
        rejoins its pool), blocking; `reason` goes to the log; returns its new slot. Raises KeyError (no
        such instance), `MoveRefused` (nothing changed), `MoveFailed` (it began)."""
        with self._lock:
            source = self.find(name)
            self.check(source, target)
            home = source.home or source.name
            self.moving = home
        parked = source.pool_state == PARKED
        direction = (PARKED if parked else source.role, target, trigger)
        logger.warning("moving %s (%s) from %s to %s: %s", source.name, home, direction[0], target, reason)
        started_s = time.monotonic()
        try:
            if parked:
                source.pool_state = "active"  # back in routing; to the other pool it drains at once
            if target == PARKED:
                slot, waited_for = source, self._drain(source)
                source.pool_state = PARKED
            elif target == source.role:
                slot, waited_for = source, None
            else:
                slot, waited_for = self._move(source, target, home)
        except Exception as e:
            self.failed[direction] += 1
            logger.error("move of %s to %s failed: %s", source.name, target, e)
            raise
        finally:
            self.moving = None
        self.moves[direction] += 1
        self.last_move_s[home] = time.monotonic()
        took_s = time.monotonic() - started_s
        logger.warning(
            "%s (%s) is now %s, moved in %.2f s (%s)", source.name, home, slot.name, took_s, reason
        )
        return {
            "instance": home,
            "name": slot.name,
            "role": target,
            "took_s": round(took_s, 3),
            "drained": waited_for,  # what it first waited for (None: it was idle)
        }

    def _move(self, source: Instance, target: str, home: str) -> tuple[Instance, str | None]:
        import ray

        source.pool_state = "draining"
        deadline_s = time.monotonic() + self.drain_timeout_s
        actor = source.leader
        transport, tls = self.topology.kv_transport, self.cluster._kv_tls
        dest = self._slot(target, home, actor)
        waited_for, handed_over = None, False
        while True:
            busy = self._driver_holds(source)
            waited_for = waited_for or busy
            if not source.health.routable:
                source.pool_state = "active"
                raise MoveFailed(f"{source.name} left routing while draining ({source.health.reason})")
            if busy is None:
                source.pool_state = "away"  # unprobed while it switches
                try:
                    address = ray.get(
                        actor.switch_role.remote(target, dest.name, transport, tls),
                        timeout=self.cluster.call_timeout_s,
                    )
                    break
                except ray.exceptions.RayTaskError as e:
                    source.pool_state = "draining"
                    if not isinstance(e.cause, RuntimeError) or "not drained" not in str(e.cause):
                        source.pool_state = "active"
                        raise MoveFailed(f"{source.name}: switching role failed: {describe_error(e)}") from e
                    busy = str(e.cause)
                except Exception as e:  # noqa: BLE001 - the actor died or hung mid-switch: it is lost
                    source.pool_state = "active"
                    self.cluster.registry.mark_failed(source.role, source.index, e, "switch_role")
                    raise MoveFailed(
                        f"{source.name} died or hung while switching to {target}: {describe_error(e)}; "
                        "its requests in flight go the failed-instance way (re-dispatched or failed)"
                    ) from e
            if time.monotonic() > deadline_s and not handed_over and self._hand_over(source):
                handed_over = True  # their re-dispatch: each a call round trip or two
                deadline_s = time.monotonic() + 2 * self.cluster.call_timeout_s
                continue
            if time.monotonic() > deadline_s:
                source.pool_state = "active"
                raise MoveFailed(
                    f"{source.name} did not drain within {self.drain_timeout_s:g} s ({busy}); it stays "
                    f"{source.role}"
                )
            time.sleep(DRAIN_POLL_S)
        for attempt in range(1, REWIRE_ATTEMPTS + 1):  # its new role runs: a passing fault is tried again
            try:
                self._rewire(ray, dest, address)
                break
            except Exception as e:  # noqa: BLE001 - out of routing until a probe rejoins it
                if attempt < REWIRE_ATTEMPTS:
                    logger.warning("%s: rewiring after a move failed (%s)", dest.name, describe_error(e))
                    continue
                dest.health, dest.pool_state = InstanceHealth(since_s=time.monotonic()), "active"
                self.cluster.registry.mark_failed(dest.role, dest.index, e, "rewiring after a move")
                raise MoveFailed(f"{dest.name}: rewiring the KV transport failed: {describe_error(e)}") from e
        return dest, waited_for

    def _drain(self, source: Instance) -> str | None:
        """Take `source` out of routing and wait until the driver holds nothing on it (at the drain bound a
        decode instance's requests are handed over, as a move's); returns what it first waited for.
        Raises `MoveFailed` (back in routing) when it leaves routing or does not drain."""
        source.pool_state = "draining"
        deadline_s, waited_for, handed_over = time.monotonic() + self.drain_timeout_s, None, False
        while (busy := self._driver_holds(source)) is not None:
            waited_for = waited_for or busy
            if not source.health.routable:
                source.pool_state = "active"
                raise MoveFailed(f"{source.name} left routing while draining ({source.health.reason})")
            if time.monotonic() > deadline_s and not handed_over and self._hand_over(source):
                handed_over = True
                deadline_s = time.monotonic() + 2 * self.cluster.call_timeout_s
            elif time.monotonic() > deadline_s:
                source.pool_state = "active"
                raise MoveFailed(f"{source.name} did not drain within {self.drain_timeout_s:g} s ({busy})")
            time.sleep(DRAIN_POLL_S)
        return waited_for

    def _slot(self, target: str, home: str, actor: Any) -> Instance:
        """`home`'s slot in pool `target`: the one it had there, or a new one at the pool's end (away)."""
        pool = self.instances[target]
        for slot in pool:
            if (slot.home or slot.name) == home:
                return slot
        slot = Instance(target, len(pool), [actor], pool_state="away", home=home, transport=pool[0].transport)
        if target == "decode":
            self.cluster._decode_addresses.append([None])
            index = self.cluster.dispatcher._loads.add_decode(1)
            assert index == slot.index, (index, slot.index)
        pool.append(slot)
        return slot

    def _hand_over(self, source: Instance) -> bool:
        """At the drain bound: re-dispatch every request running on decode `source` with its streamed tokens
        kept (a `DecodeLost` to each attempt: `driver.recompute`, counted and logged per request). False
        (nothing done) when off, not a decode instance, or a request refuses (`recompute_refusal`)."""
        from pdcluster.driver.messages import DecodeLost
        from pdcluster.driver.recompute import recompute_refusal

        if source.role != "decode" or not self.topology.autoscale.recompute_at_drain_bound:
            return False
        dispatcher = self.cluster.dispatcher
        records = [
            r
            for r in list(dispatcher._requests.values())
            if r.attempt is not None and r.attempt.decode_index == source.index and not r.finished
        ]
        for r in records:
            refusal = recompute_refusal(r.params, r.num_recomputes, r.aborted) if r.params else "unknown"
            if refusal is not None:
                logger.warning(
                    "%s: %s cannot be re-dispatched (%s): no hand-over", source.name, r.request_id, refusal
                )
                return False
        message = f"{source.name} left the decode pool (a move) before it finished"
        attempts = [r.attempt for r in records if r.attempt is not None]

        def post() -> None:
            for attempt in attempts:
                attempt.events.put_nowait(DecodeLost(attempt.handoff_id, message))

        dispatcher._loop.call_soon_threadsafe(post)
        logger.warning(
            "%s: drain bound passed; %d running requests re-dispatched", source.name, len(attempts)
        )
        return True

    def _driver_holds(self, source: Instance) -> str | None:
        """What the driver still has on `source` (requests whose attempt uses it), None when nothing."""
        dispatcher = self.cluster.dispatcher
        loads = dispatcher._loads
        ref = RankRef(source.index, 0)
        if source.role == "prefill":
            held = sum(
                1
                for r in list(dispatcher._requests.values())
                if r.attempt is not None
                and r.attempt.prefill_index == source.index
                and r.attempt.prefill_call is not None
                and not r.attempt.prefill_call.done()
            )
            calls = loads.prefill_calls(ref)
            return f"{held} prefills in flight" if held or calls else None
        held = sum(
            1
            for r in list(dispatcher._requests.values())
            if r.attempt is not None and r.attempt.decode_index == source.index and not r.finished
        )
        reserving = loads._reserving.get(ref, 0)
        return f"{held} requests decoding" if held or reserving else None

    def _rewire(self, ray, dest: Instance, address: Any) -> None:
        """Point every prefill rank at the decode receivers (slots away get a live one's address: nothing
        is routed there), then put `dest` in routing with fresh health and clients."""
        cluster = self.cluster
        if dest.role == "decode":
            if self.topology.kv_transport == "grpc" and not cluster._loopback:
                from pdcluster.driver.wiring import advertised_address

                ip = ray.get(dest.leader.node_ip.remote(), timeout=cluster.call_timeout_s)
                address = advertised_address(address, ip)
            cluster._decode_addresses[dest.index] = [address]
        addresses = cluster._kv_addresses(joining=dest)
        prefills = [p for p in cluster.instances["prefill"] if p.pool_state != "away" or p is dest]
        ray.get(
            [
                a.connect_receivers.remote(self.topology.kv_transport, addresses, cluster._kv_tls)
                for p in prefills
                for a in p.ranks
            ],
            timeout=cluster.call_timeout_s,
        )
        source_pid = next(
            (
                s.health.pid
                for r in ROLES
                for s in self.instances[r]
                if s.leader is dest.leader and s is not dest
            ),
            None,
        )
        dest._clients.clear()  # fresh event and command streams for the new role object
        if dest.role == "decode":
            cluster.dispatcher._loads.forget_decode(dest.index)
        dest.health = InstanceHealth(since_s=time.monotonic(), pid=source_pid)
        dest.pool_state = "active"
