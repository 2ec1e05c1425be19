"""Instance health: telling a stalled actor from a dead one, and when an instance rejoins routing.

Pure policy over plain data (no Ray calls), used by `orchestrator.cluster.Cluster`:

    HEALTHY ──call timed out──▶ UNRESPONSIVE ──answers, same process──▶ HEALTHY
       │                             │
       ├──actor died──▶ DEAD ◀───────┘ (died while unresponsive, or killed: silent past the watchdog)
       │                 │
       │                 └──answers, new process (Ray restarted it)──▶ rewired ──▶ HEALTHY
       └──engine failed (answers, but its engine thread died or is stuck: `engine_fault`)──▶ DEAD

Only HEALTHY instances are routed to. An instance leaves HEALTHY when one call on the request path
times out (`call_timeout_s`, derived from `kv_transfer.timeout_s`) or raises an actor error; its in-flight
requests fail then (their KV state lives on it). The cluster's health monitor probes every instance that
is not HEALTHY every `probe_interval_s`; the probe's answer carries the actor's process id, so a restarted
actor (a new process in the same placement group bundle) is told from one that was only stalled: the
restarted one is rewired (its KV transport connected again) before it rejoins.

An actor can answer while its engine does not run: its engine thread died, or hangs in a step (a deadlock,
a kernel that never returns). `engine_fault` is the watchdog over what a probe's load reports: such an
instance is failed as DEAD, like one whose actor died, and stays out of routing while its engine fails
(the monitor has Ray restart it where Ray restarts actors). An actor can also stop answering altogether and
stay so (a native call hung holding the GIL, a process stopped): `unresponsive_too_long` says when an
UNRESPONSIVE instance has been silent past the same watchdog, and the monitor then has Ray restart it too.
A restart can hang as well (its weights on a file system that stopped answering): `restart_overdue` says
when a DEAD instance's probes have said "restarting" (or timed out) for longer than deploy waits for a rank
to load, and the monitor has Ray start it once more, once per death.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.orchestrator.messages import DecodeNodeLoad, PrefillNodeLoad


class Health(enum.Enum):
    HEALTHY = "healthy"  # answers within the call timeout; routed to
    UNRESPONSIVE = "unresponsive"  # a call timed out: out of routing, probed until it answers
    DEAD = "dead"  # a call said its process died, or its engine failed: out of routing; rejoins when a
    # probe is answered with a working engine (by a process Ray restarted, rewired first, or by the same
    # one: then the error was not its death, or its engine passes again)


@dataclasses.dataclass(frozen=True)
class InstanceHealth:
    """One instance's health as the driver sees it.

    Attributes:
        state: see `Health`.
        reason: why it left HEALTHY (the failed call and its error); "" while healthy.
        since_s: time.monotonic() of the last state change, in seconds.
        pid: process id of the actor incarnation last seen answering (None before the first answer).
    """

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
    """The health after a call on the request path (or a probe) failed with `outcome`.

    A timeout makes a healthy instance UNRESPONSIVE (a DEAD one stays DEAD); an actor error makes it DEAD.
    The first reason is kept while the state does not change.

    Raises:
        ValueError: outcome is ANSWERED (use `after_answer`).
    """
    if outcome is ProbeOutcome.ANSWERED:
        raise ValueError("after_failure takes a failed outcome; use after_answer for an answer")
    state = (
        Health.DEAD if outcome is ProbeOutcome.DIED or health.state is Health.DEAD else Health.UNRESPONSIVE
    )
    if state is health.state:
        return health
    return dataclasses.replace(health, state=state, reason=reason, since_s=now_s)


def is_stale(health: InstanceHealth, issued_at_s: float | None) -> bool:
    """Whether the failure of a call issued at `issued_at_s` (time.monotonic(); None: unknown, never stale)
    is older than what `health` knows: the instance is HEALTHY since after that call went out, so it
    answered a probe later than the call was sent (it rejoined after a stall or a restart). Its timeout
    then says the reply came late (the rank worked through a backlog after a stall, or the driver's event
    loop ran the timeout late), not that the instance is unresponsive now: a fault that persists fails the
    next call, issued after the rejoin, which is not stale."""
    return issued_at_s is not None and health.state is Health.HEALTHY and issued_at_s < health.since_s


def after_answer(health: InstanceHealth, pid: int, now_s: float) -> tuple[InstanceHealth, bool]:
    """The health after the instance answered a call from process `pid`, and whether it must be rewired
    first (True when `pid` is a new incarnation of an instance seen before: Ray restarted the actor, so
    its transport endpoints are new). A rewired instance is HEALTHY once the caller has rewired it."""
    needs_rewire = health.pid is not None and pid != health.pid
    if health.state is Health.HEALTHY and not needs_rewire:
        return (health if health.pid == pid else dataclasses.replace(health, pid=pid)), False
    return InstanceHealth(Health.HEALTHY, "", now_s, pid), needs_rewire


# A pass over the watchdog must still be the current pass this long later on the driver's clock (at most the
# watchdog itself) before it is a fault: a process paused whole (SIGSTOP, swapping) answers its first probe
# after resuming with a pass clock that counts the pause, and gets this long to finish that pass (the
# monitor forgets a sighting when a probe goes unanswered, so the pause itself does not count here; a
# pause longer than the watchdog is `unresponsive_too_long`).
STUCK_CONFIRM_S = 10.0


def engine_fault(
    load: PrefillNodeLoad | DecodeNodeLoad,
    watchdog_s: float,
    stuck_before: tuple[int, int, float] | None,
    now_s: float,
) -> tuple[str | None, tuple[int, int, float] | None]:
    """The engine watchdog, for one rank's load taken by a probe at `now_s` (the driver's time.monotonic(),
    seconds): whether its engine has failed.

    It has when its engine thread is not alive, or when one pass of its loop has run longer than
    `watchdog_s` seconds and the driver has seen that same pass (process id and pass number) over the
    watchdog for at least min(`watchdog_s`, `STUCK_CONFIRM_S`) seconds (`stuck_before`: what this
    function returned at the previous probe).

    Returns:
        (fault, stuck): `fault` says why the engine failed (None: it did not); `stuck` is (pid, pass
        number, when first seen over the watchdog) of a pass over the watchdog, to pass as `stuck_before`
        at the next probe (None: none).
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
    """Whether an instance has answered nothing for too long (`now_s`: time.monotonic(), seconds): it is
    UNRESPONSIVE (a call or probe timed out), from a known process, and has been silent since it became so
    or since its last answered probe (`last_answer_s`; an answer that did not bring it back, e.g. mid-pass,
    still shows it alive), whichever is later, for at least `watchdog_s` (the pool's `engine_watchdog_s`)
    and at least `min_silent_s` (the monitor's floor: two unanswered probes, so that a watchdog shorter than
    a call's timeout does not make one late answer a kill). Such a process is not coming back by itself
    often enough to wait for: its engine cannot have passed the watchdog either.

    Returns:
        why (the reason to log and report), or None.
    """
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
    """Whether the restart of a DEAD instance is overdue (`now_s`: time.monotonic(), seconds): nothing has
    answered since it became DEAD or since `last_sign_s` (its last answered probe, or the monitor's last
    kill of it), whichever is later, for at least `start_timeout_s` (how long deploy waits for a rank to
    load: `deployment.ready_timeout_s`).

    Call it only for a probe that says Ray may still bring the actor up (the monitor's `_restart_pending`:
    Ray's "the actor is restarting", or a timeout, as for a replacement actor still being created), not for
    one Ray has given up on.

    Returns:
        why (the reason to log and report), or None.
    """
    if health.state is not Health.DEAD:
        return None
    silent_s = now_s - max(health.since_s, last_sign_s)
    if silent_s < start_timeout_s:
        return None
    return (
        f"its restart has answered no call for {silent_s:.1f} s (a rank must load within "
        f"{start_timeout_s:g} s; dead since: {health.reason})"
    )
