"""`workers.thread_clock.run_delay_s`: the calling thread's wait for a CPU, as Linux counts it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdcluster.workers.thread_clock import run_delay_s

SPIN_S = 0.4  # each side spins this long on one shared CPU


def _spin(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


@pytest.mark.skipif(run_delay_s() is None, reason="this OS does not report per-thread run-queue waits")
def test_a_thread_sharing_its_cpu_with_a_busy_process_waits_for_it() -> None:
    """Pinned to one CPU with a busy process pinned there too, the thread spends a share of its spin in the
    run queue: the wait grows by a clear fraction of the spin (CFS would give each side about half; the
    bound is a tenth, so other load on the machine only makes it larger), and never decreases."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    cpu = min(os.sched_getaffinity(0))
    before_affinity = os.sched_getaffinity(0)
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nd = time.monotonic() + "
         f"{3 * SPIN_S}\nwhile time.monotonic() < d: pass"]
    )  # fmt: skip
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only (pid 0: the calling thread)
        time.sleep(0.1)  # the busy process is up and pinned
        waited_before_s = run_delay_s()
        _spin(SPIN_S)
        waited_s = run_delay_s() - waited_before_s
    finally:
        os.sched_setaffinity(0, before_affinity)
        busy.kill()
        busy.wait()
    assert waited_s >= SPIN_S / 10, waited_s
    assert run_delay_s() >= waited_before_s
