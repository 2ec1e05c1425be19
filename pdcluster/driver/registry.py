"""`InstanceRegistry`: the deployed instances and their health, with one writer."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pdcluster.config import ROLES
from pdcluster.driver.actor_errors import describe_error
from pdcluster.driver.health import InstanceHealth, ProbeOutcome, after_failure, is_stale
from pdcluster.driver.instance import Instance

logger = logging.getLogger("pdcluster.driver.cluster")


def probe_outcome(exc: BaseException) -> ProbeOutcome:
    """A failed call's outcome: it timed out, or the actor died."""
    import ray

    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ray.exceptions.GetTimeoutError)):
        return ProbeOutcome.TIMED_OUT
    return ProbeOutcome.DIED


def restart_pending(exc: BaseException) -> bool:
    """Whether a failed call says nothing of the actor's death: a timeout or ActorUnavailableError."""
    import ray

    return probe_outcome(exc) is ProbeOutcome.TIMED_OUT or isinstance(
        exc, ray.exceptions.ActorUnavailableError
    )


class InstanceRegistry:
    """`instances`: role -> the pool's `Instance`s in order."""

    def __init__(
        self,
        instances: dict[str, list[Instance]],
        call_timeout_s: float,
        on_failed: Callable[[str, int, bool], None] = lambda role, index, left_routing: None,
    ) -> None:
        self.instances = instances
        self.call_timeout_s = call_timeout_s
        self.on_failed = on_failed
        self.lock = threading.Lock()

    def health_of(self, role: str) -> list[InstanceHealth]:
        return [instance.health for instance in self.instances[role]]

    def set_health(self, role: str, index: int, health: InstanceHealth) -> None:
        self.instances[role][index].health = health

    def routable(self, role: str) -> list[bool]:
        """Per instance of pool `role`, in pool order: in routing (healthy)."""
        return [instance.routable for instance in self.instances[role]]

    def summary(self, role: str) -> str:
        """`decode-0 healthy; decode-1 dead: <why>`."""
        return "; ".join(
            f"{role}-{i} {h.state.value}" + (f": {h.reason}" if h.reason else "")
            for i, h in enumerate(self.health_of(role))
            if self.instances[role][i].pool_state != "away"
        )

    def health(self) -> dict[str, dict[str, Any]]:
        """Every instance's health: `{name: {"state": "healthy" | "unresponsive" | "dead", "reason": str,
        "for_s": seconds in that state, "ranks": live ranks, "deployed_ranks", "degraded": bool,
        "recoveries": shrinks so far}}` (no calls made)."""
        now_s = time.monotonic()
        return {
            instance.name: {
                "state": instance.health.state.value,
                "reason": instance.health.reason,
                "for_s": round(now_s - instance.health.since_s, 3),
                "ranks": instance.num_ranks,
                "deployed_ranks": instance.num_deployed_ranks,
                "degraded": instance.degraded,
                "recoveries": instance.recoveries,
                "rejoins": instance.rejoins,
                **({"pool_state": instance.pool_state, "home": instance.home} if instance.home else {}),
            }
            for role in ROLES
            for instance in self.instances[role]
            if instance.pool_state != "away"
        }

    def mark_failed(
        self, role: str, index: int, exc: BaseException, call: str, issued_at_s: float | None = None
    ) -> None:
        """A call `call` on instance (`role`, `index`) timed out or raised an actor error: take it out of
        routing (unresponsive or dead) and tell `on_failed`.
        """
        if probe_outcome(exc) is ProbeOutcome.TIMED_OUT:
            reason = f"{call}: no answer within {self.call_timeout_s:g} s"
        else:
            reason = f"{call}: {describe_error(exc)}"
        with self.lock:
            if self.instances[role][index].pool_state == "away":  # a call that raced its move: not a failure
                return
            before = self.instances[role][index].health
            # Not an actor-died error: that may come from a process that died after its probe answered.
            if restart_pending(exc) and is_stale(before, issued_at_s):
                assert issued_at_s is not None
                logger.warning(
                    "%s-%d: ignored a failed call (%s) sent %.2f s before the instance rejoined routing",
                    role,
                    index,
                    reason,
                    before.since_s - issued_at_s,
                )
                return
            after = after_failure(before, probe_outcome(exc), reason, time.monotonic())
            self.set_health(role, index, after)
        if after is not before:
            logger.error("%s-%d is %s (%s); taken out of routing", role, index, after.state.value, reason)
        self.on_failed(role, index, after is not before)

    def rejoin(self, role: str, index: int, before: InstanceHealth, after: InstanceHealth) -> InstanceHealth:
        """Set (`role`, `index`)'s health to `after` if it is still `before` (compare and set); returns the
        health it has now."""
        with self.lock:
            now = self.instances[role][index].health
            if now is before:
                self.set_health(role, index, after)
                return after
            return now
