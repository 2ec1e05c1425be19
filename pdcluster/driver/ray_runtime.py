"""Starting Ray for pdcluster: the options every local Ray session of ours uses."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Workers run at the driver's priority, not Ray's nice 15: the actors are the workload.
LOCAL_RAY_SYSTEM_CONFIG: dict[str, Any] = {"worker_niceness": 0}
# Ray's startup waits can run out on a busy host; `init_local_ray` retries this many times.
STARTUP_RETRIES = 2
GCS_PORT_WAIT_S = 120
_GCS_PORT_WAIT_VARIABLE = "RAY_gcs_server_port_wait_time_s"
_STARTUP_TIMEOUT_MESSAGES = ("timed out during startup", "Timed out waiting for file")

logger = logging.getLogger(__name__)


def init_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """Start a local Ray instance with `num_cpus` logical CPUs and pdcluster's system config.

    kwargs override the `ray.init` defaults. A start that runs out of Ray's startup waits is retried
    `STARTUP_RETRIES` times after killing the processes it started.
    Raises ValueError for num_cpus < 1, RuntimeError (or Ray's startup Exception) if Ray fails to start.
    """
    import ray

    if num_cpus < 1:
        raise ValueError(f"num_cpus must be >= 1, got {num_cpus}")
    options: dict[str, Any] = dict(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _system_config=dict(LOCAL_RAY_SYSTEM_CONFIG),
    )
    options.update(kwargs)
    for attempt in range(STARTUP_RETRIES + 1):
        children = _child_pids()
        try:
            with _environment_default(_GCS_PORT_WAIT_VARIABLE, str(GCS_PORT_WAIT_S)):
                ray.init(**options)
            return
        except (KeyboardInterrupt, SystemExit):
            with contextlib.suppress(Exception):
                ray.shutdown()
            _kill(_descendants(_child_pids() - children))
            raise
        except Exception as e:
            if not any(m in str(e) for m in _STARTUP_TIMEOUT_MESSAGES):
                raise
            # Ray never recorded a node that failed to start: kill its daemons, this process's new children.
            ray.shutdown()
            stopped = _kill(_child_pids() - children)
            if attempt == STARTUP_RETRIES:
                raise
            logger.warning(
                "Ray did not start in time (%s); stopped the %d processes it had started; starting again",
                e,
                stopped,
            )


def _parent_pids() -> dict[int, int]:
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(") ", 1)[1].split()[1])
    return parents


def _child_pids() -> set[int]:
    me = os.getpid()
    return {pid for pid, parent in _parent_pids().items() if parent == me}


def _descendants(pids: set[int]) -> set[int]:
    """`pids` and every process below them (the raylet's agents outlive it)."""
    parents = _parent_pids()
    found, frontier = set(pids), set(pids)
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _kill(pids: set[int]) -> int:
    """SIGKILL and reap each of `pids`; how many were still there."""
    killed = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return killed


@contextmanager
def _environment_default(name: str, value: str) -> Iterator[None]:
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


@contextmanager
def keeping_sigterm_handler() -> Iterator[None]:
    """Put the caller's SIGTERM handler back after the block (`ray.init` replaces it with `sys.exit(15)`).

    A SIGTERM during the block is handed to the caller's handler; outside the main thread this does nothing.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    except SystemExit as exc:
        if callable(previous) and exc.code == signal.SIGTERM:
            previous(signal.SIGTERM, None)
        raise
    finally:
        if main and (callable(previous) or previous == signal.SIG_IGN):
            signal.signal(signal.SIGTERM, previous)


def gcs_reachable(timeout_s: float = 1.0) -> bool:
    """False only when a connection to the local Ray head's GCS is refused (Ray's processes are gone).

    True on a timeout or an unknown address; meant for a head this process started.
    """
    import socket

    import ray

    try:
        host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except Exception:  # noqa: BLE001 - a timeout, or no address to probe: assume Ray is there
        return True
