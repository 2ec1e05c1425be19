"""How long the calling thread waited for a CPU: the run-queue delay Linux keeps per thread.

A prefill engine thread that is ready to run but finds every core taken (by the decode actor, the driver,
the client, Ray's daemons: on a small host they share the prefill node's cores) waits in the scheduler's
run queue; that wait is part of the request's prefill time without being compute. Linux counts it per
thread in `/proc/thread-self/schedstat` (second field, nanoseconds: "time spent waiting on a runqueue",
Documentation/scheduler/sched-stats.rst); `run_delay_s` reads it. Where the file does not exist (another
OS, a kernel without schedstats) it returns None and the phase is not reported.
"""

from __future__ import annotations

SCHEDSTAT_PATH = "/proc/thread-self/schedstat"


def run_delay_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU since it started (monotonic
    over the thread's life; differences give the wait over an interval); None where the OS does not say."""
    try:
        with open(SCHEDSTAT_PATH, "rb") as f:
            fields = f.read().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
