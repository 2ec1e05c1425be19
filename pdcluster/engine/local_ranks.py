"""Run a function on N spawned local processes (the ranks of one EP instance on this machine) and collect what
each returns; never hangs.
"""

from __future__ import annotations

import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from pdcluster.kvtransfer.ports import free_ports


class RanksFailed(AssertionError):
    """Some rank raised, died or did not finish in time; the message says which and why."""


def free_port() -> int:
    """A port free on 127.0.0.1 for the ranks' rendezvous (`kvtransfer.ports.free_ports`)."""
    return free_ports("127.0.0.1", 1)[0]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(rank, world_size, port, *args)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0, allow_failed: tuple = ()
) -> dict[int, Any]:
    """`{rank: fn's return value}`; ranks in `allow_failed` may raise or die (their entry is then the
    traceback string, or None when they died without reporting).
    Raises RanksFailed: another rank raised, died, or the ranks were not all done within `timeout_s`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    done: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                silent = [r for r, p in enumerate(procs) if r not in done and not p.is_alive()]
                if silent:
                    time.sleep(0.5)
                    if results.empty():
                        for r in silent:
                            done.add(r)
                            if r in allow_failed:
                                out[r] = None
                            else:
                                errors.append(
                                    f"rank {r}: died (exit code {procs[r].exitcode}) without a result"
                                )
                if time.monotonic() > deadline:
                    errors.append(
                        f"ranks {sorted(set(range(world_size)) - done)}: not done after {timeout_s} s"
                    )
                    break
                continue
            done.add(rank)
            if ok or rank in allow_failed:
                out[rank] = value
            else:
                errors.append(f"rank {rank}: raised\n{value}")
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise RanksFailed("\n".join(errors))
    return out
