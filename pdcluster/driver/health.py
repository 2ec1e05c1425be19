"""Instance health: telling a stalled actor from a dead one, and when an instance rejoins routing."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.driver.messages import DecodeNodeLoad, PrefillNodeLoad


class Health(enum.Enum):
    HEALTHY = "healthy"  # answers within the call timeout; routed to
    UNRESPONSIVE = "unresponsive"  # a call timed out: out of routing, probed until it answers
    DEAD = "dead"  # its process died or engine failed: out of routing until a probe finds a working engine


@dataclasses.dataclass(frozen=True)
class InstanceHealth:
    """One instance's health as the driver sees it."""

    state: Health = Health.HEALTHY
    reason: str = ""
    since_s: float = 0.0
    pid: int | None = None

    @property
    def routable(self) -> bool:
        return self.state is Health.HEALTHY


class ProbeOutcome(enum.Enum):
    ANSWERED = "answered"
    TIMED_OUT = "timed_out"
    DIED = "died"


def after_failure(health: InstanceHealth, outcome: ProbeOutcome, reason: str, now_s: float) -> InstanceHealth:
    """The health after a call or probe failed with `outcome`; ValueError for ANSWERED (`after_answer`)."""
    if outcome is ProbeOutcome.ANSWERED:
        raise ValueError("after_failure takes a failed outcome; use after_answer for an answer")
    state = (
        Health.DEAD if outcome is ProbeOutcome.DIED or health.state is Health.DEAD else Health.UNRESPONSIVE
    )
    if state is health.state:
        return health
    return dataclasses.replace(health, state=state, reason=reason, since_s=now_s)


def is_stale(health: InstanceHealth, issued_at_s: float | None) -> bool:
    """Whether a call issued at `issued_at_s` (time.monotonic(), s; None: never stale) predates the
    instance's current HEALTHY state, so its failure is stale."""
    return issued_at_s is not None and health.state is Health.HEALTHY and issued_at_s < health.since_s


def after_answer(health: InstanceHealth, pid: int, now_s: float) -> tuple[InstanceHealth, bool]:
    """The health after the instance answered from process `pid`, and whether it must be rewired first
    (a new pid: Ray restarted the actor)."""
    needs_rewire = health.pid is not None and pid != health.pid
    if health.state is Health.HEALTHY and not needs_rewire:
        return (health if health.pid == pid else dataclasses.replace(health, pid=pid)), False
    return InstanceHealth(Health.HEALTHY, "", now_s, pid), needs_rewire


# A pass over the watchdog must be seen this long (seconds, driver's clock) before it is a fault.
STUCK_CONFIRM_S = 10.0


def engine_fault(
    load: PrefillNodeLoad | DecodeNodeLoad,
    watchdog_s: float,
    stuck_before: tuple[int, int, float] | None,
    now_s: float,
) -> tuple[str | None, tuple[int, int, float] | None]:
    """The engine watchdog over one rank's load probed at `now_s` (driver's time.monotonic(), seconds).

    Returns (fault, stuck): why the engine failed (None: it did not), and (pid, pass number, first seen)
    of a pass over the watchdog, for `stuck_before` at the next probe (None: none).
    """
    if not load.engine_thread_alive:
        return f"{load.name}: its engine thread died (last error: {load.last_engine_error or 'none'})", None
    if load.engine_pass_s <= watchdog_s:
        return None, None
    if stuck_before is None or stuck_before[:2] != (load.pid, load.engine_passes):
        return None, (load.pid, load.engine_passes, now_s)
    if now_s - stuck_before[2] < min(watchdog_s, STUCK_CONFIRM_S):
        return None, stuck_before
    return (
        f"{load.name}: its engine thread has been in one pass of its loop for {load.engine_pass_s:.1f} s "
        f"(engine_watchdog_s {watchdog_s:g})",
        stuck_before,
    )


def unresponsive_too_long(
    health: InstanceHealth, watchdog_s: float, now_s: float, last_answer_s: float, min_silent_s: float
) -> str | None:
    """Why an UNRESPONSIVE instance is silent too long: since it became so or `last_answer_s` (seconds)
    for at least max(`watchdog_s`, `min_silent_s`); else None."""
    if health.state is not Health.UNRESPONSIVE or health.pid is None:
        return None
    silent_s = now_s - max(health.since_s, last_answer_s)
    if silent_s < max(watchdog_s, min_silent_s):
        return None
    return (
        f"it has answered no call for {silent_s:.1f} s (engine_watchdog_s {watchdog_s:g}; "
        f"unresponsive since: {health.reason})"
    )


def restart_overdue(
    health: InstanceHealth, start_timeout_s: float, now_s: float, last_sign_s: float
) -> str | None:
    """Why a DEAD instance's restart is overdue: silent since it died or `last_sign_s` (seconds) for at
    least `start_timeout_s`; else None."""
    if health.state is not Health.DEAD:
        return None
    silent_s = now_s - max(health.since_s, last_sign_s)
    if silent_s < start_timeout_s:
        return None
    return (
        f"its restart has answered no call for {silent_s:.1f} s (a rank must load within "
        f"{start_timeout_s:g} s; dead since: {health.reason})"
    )
