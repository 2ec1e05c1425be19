"""Starting Ray for pdcluster: one place for the options every local Ray session of ours uses.

Used by `Cluster.deploy` (when no Ray is running and RAY_ADDRESS is unset), the benchmarks and the tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Ray starts its worker processes (our prefill and decode actors among them) at niceness 15 by default,
# so that its own daemons stay responsive. For a serving system that is backwards: the actors *are* the
# workload, and at nice 15 any other busy process on the host takes ~97% of the CPU from them (CFS weight
# 36 against 1024), turning seconds into minutes. Seen here: with two busy processes on a 2-core machine,
# loading two actors took over 3 minutes instead of ~5 s. Workers run at the driver's priority instead.
LOCAL_RAY_SYSTEM_CONFIG: dict[str, Any] = {"worker_niceness": 0}
# Two of Ray's startup waits can run out on a host whose cores other processes keep busy (both seen with
# two CPU burners on 2 cores):
# - the raylet's fixed 30 s to register with the GCS (ray._private.node, not configurable): an Exception
#   "... timed out during startup";
# - the driver's wait for the GCS to publish its port, 30 s by default: RuntimeError "Timed out waiting
#   for file .../gcs_server_port_...". Ray reads RAY_gcs_server_port_wait_time_s for it (its default is
#   120 s with the RocksDB GCS); `init_local_ray` sets GCS_PORT_WAIT_S there for its `ray.init` unless the
#   user has set it.
# After either, `init_local_ray` shuts the half-started session down and tries this many times more.
STARTUP_RETRIES = 1
GCS_PORT_WAIT_S = 120
_GCS_PORT_WAIT_VARIABLE = "RAY_gcs_server_port_wait_time_s"
_STARTUP_TIMEOUT_MESSAGES = ("timed out during startup", "Timed out waiting for file")

logger = logging.getLogger(__name__)


def init_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """Start a local Ray instance with `num_cpus` logical CPUs and pdcluster's system config.

    Args:
        num_cpus: logical CPUs Ray may hand out (>= 1); actors reserve them, they do not pin cores.
        kwargs: further `ray.init` keyword arguments (override the defaults below).

    The driver waits up to GCS_PORT_WAIT_S for Ray's GCS to come up (RAY_gcs_server_port_wait_time_s, if
    set, wins; Ray also counts its GCS connection attempts by it). A start that runs out of either of Ray's
    startup waits is retried `STARTUP_RETRIES` times, with a warning, after `ray.shutdown()` and after
    killing the processes it had started (this process's children started during the attempt: Ray cannot
    shut down a node it never finished recording); any other failure is raised at once.

    Raises:
        ValueError: num_cpus < 1.
        RuntimeError: Ray failed to start (as raised by `ray.init`; Ray's startup timeout as an
            `Exception` once the retries are spent).
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
        except (KeyboardInterrupt, SystemExit):  # a Ctrl-C or SIGTERM mid-start: nothing of it may stay
            with contextlib.suppress(Exception):
                ray.shutdown()
            _kill(_descendants(_child_pids() - children))
            raise
        except Exception as e:
            if not any(m in str(e) for m in _STARTUP_TIMEOUT_MESSAGES):
                raise
            # A start that failed inside Ray's Node leaves Ray nothing to shut down (it never recorded the
            # node), so the daemons it started (the GCS, the raylet) would keep running, on a host already
            # too busy: they are this process's children started since.
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
    """Every process's parent process id, by process id (Linux: from /proc; elsewhere empty)."""
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(") ", 1)[1].split()[1])
    return parents


def _child_pids() -> set[int]:
    """The process ids of this process's children (Linux: from /proc; elsewhere none are known)."""
    me = os.getpid()
    return {pid for pid, parent in _parent_pids().items() if parent == me}


def _descendants(pids: set[int]) -> set[int]:
    """`pids` and every process below them (Linux: from /proc): Ray's raylet starts agents of its own,
    which outlive a raylet killed alone by a minute or more."""
    parents = _parent_pids()
    found, frontier = set(pids), set(pids)
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _kill(pids: set[int]) -> int:
    """SIGKILL each of `pids` and reap it; how many were still there."""
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
    """os.environ[name] = value inside the block unless it is set already; as it was afterwards."""
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
    """Put the caller's SIGTERM handler back after the block (a `ray.init`).

    `ray.init` replaces the driver's SIGTERM handler with `sys.exit(15)`, and Ray's core worker then adds a
    C-level handler that prints a stack dump ("*** SIGTERM received at time=...") before chaining to it,
    so a program that shuts down cleanly on SIGTERM (`pdcluster deploy`) would die mid-way instead. Only a
    Python handler the caller installed (or SIG_IGN) is restored; with the default one, Ray's stays. A
    SIGTERM that came during the block, and so met Ray's `sys.exit(15)`, is handed to the caller's handler
    (deploy's raises KeyboardInterrupt: it then shuts down as it would have). Outside the main thread
    (where handlers cannot be set) this does nothing.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    except SystemExit as exc:
        # a SIGTERM inside the block met Ray's handler (`sys.exit(15)`): the caller's handler takes it
        if callable(previous) and exc.code == signal.SIGTERM:
            previous(signal.SIGTERM, None)  # (the finally below puts it back as the handler)
        raise
    finally:
        if main and (callable(previous) or previous == signal.SIG_IGN):
            signal.signal(signal.SIGTERM, previous)


def gcs_reachable(timeout_s: float = 1.0) -> bool:
    """Whether the GCS of a Ray head this process started (`init_local_ray`) is still there: False only
    when a connection to its address is refused. That happens when Ray's own processes are gone: e.g. a
    SIGTERM to the whole process group (systemd's default `KillMode`, coreutils `timeout`) reaches the GCS
    and raylet that `ray.init` started as children, and they exit at once; a Ray call would then block
    until Ray's core worker gives up (60 s) and ends the process. True on a timeout, or when the address
    cannot be known (the caller goes the normal way). Meant for a local head only: a remote GCS that does
    not answer the driver's connect is no sign that it is gone."""
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
