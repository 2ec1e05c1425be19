"""How long the calling thread waited for a CPU: the run-queue delay Linux keeps per thread."""

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
