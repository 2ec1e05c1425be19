"""OpenAI-compatible servers as child processes for a benchmark: start, wait until they serve, stop, and
check that nothing of theirs outlives them (processes, the port).

Each server runs in its own session (process group), its stdout and stderr going to one log file, with
SIGTERM as its parent-death signal (Linux), so a benchmark killed outright does not leave it serving.
`stop()` sends SIGTERM to the server's main process (each server here shuts down cleanly on it: `pdcluster
deploy` stops its actors and the Ray it started, uvicorn its app, vLLM its engine core), waits, then
SIGKILLs the process group and every process that descended from it when `stop()` began (Ray's daemons
and workers among them, wherever they moved). Process trees are read from /proc (Linux only).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1
STRAGGLER_GRACE_S = 10.0  # `stop`: the least time a server's descendants get to exit after it did
ROOT = Path(__file__).resolve().parent.parent  # the repository: where `python -m bench.X` resolves


class ServerStartError(RuntimeError):
    """A server exited or did not answer `GET /v1/models` in time; the message names it and holds its log
    tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _children_map() -> dict[int, list[int]]:
    """ppid -> [pid] for every process /proc shows now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children, their children, ...), from /proc."""
    children, out, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# Sets the parent-death signal, then execs the server. A launcher rather than Popen's preexec_fn: that one
# forces a plain fork(), whose atfork handlers (gRPC's, once imported) run in the child and may abort it.
_PDEATHSIG_EXEC = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(int(sys.argv[1]), int(sys.argv[2]));"
    "os.getppid() == int(sys.argv[3]) or sys.exit('parent already gone');"
    "os.execvp(sys.argv[4], sys.argv[4:])"
)


def _with_parent_death_signal(argv: Sequence[str]) -> list[str]:
    """`argv` behind the launcher: SIGTERM reaches the server when this process dies (Linux)."""
    pdeathsig = [str(PR_SET_PDEATHSIG), str(int(signal.SIGTERM)), str(os.getpid())]
    return [sys.executable, "-c", _PDEATHSIG_EXEC, *pdeathsig, *argv]


@dataclass
class ServerProcess:
    """One server: `argv` run with `env` in `cwd`, serving the OpenAI API on 127.0.0.1:`port`."""

    name: str
    argv: Sequence[str]
    port: int
    log_path: Path
    env: dict[str, str] | None = None
    cwd: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        """Start the process (returns at once; `wait_all_ready` waits until it serves)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                _with_parent_death_signal(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    def log_tail(self, num_lines: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(lines[-num_lines:])

    def _failure(self, what: str) -> ServerStartError:
        return ServerStartError(
            f"server {self.name!r} {what}; command: {' '.join(self.argv)}\n"
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def poll_ready(self) -> bool:
        """Whether `GET /v1/models` answers 200 now.

        Raises:
            ServerStartError: the process has exited.
        """
        assert self.process is not None, "start() first"
        rc = self.process.poll()
        if rc is not None:
            raise self._failure(f"exited with code {rc} before it served")
        try:
            return httpx.get(self.url + "/v1/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 60.0) -> dict[str, object]:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL the group and the descendants seen at the start.

        Returns:
            `{"exit_code", "killed": bool, "leaked_pids": [...], "port_in_use": bool}`: the main process's
            exit code, whether SIGKILL was needed, and what still lives / listens after all of that.
        """
        if self.process is None:
            return {"exit_code": None, "killed": False, "leaked_pids": [], "port_in_use": False}
        tree = descendants(self.process.pid)
        killed = False
        deadline_s = time.monotonic() + timeout_s
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                killed = True
        # Ray's daemons and vLLM's engine core may linger after their parent exits: the same timeout_s
        # holds for them (at least STRAGGLER_GRACE_S after the main process ended)
        grace = max(deadline_s, time.monotonic() + STRAGGLER_GRACE_S)
        while any(alive(p) for p in tree) and time.monotonic() < grace and not killed:
            time.sleep(0.2)
        stragglers = [p for p in tree if alive(p)]
        if killed or stragglers or self.process.poll() is None:
            killed = killed or bool(stragglers)
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for pid in stragglers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.2)
        return {
            "exit_code": self.process.poll(),
            "killed": killed,
            "leaked_pids": [p for p in [self.process.pid, *tree] if alive(p)],
            "port_in_use": port_in_use(self.port),
        }


def wait_all_ready(servers: Sequence[ServerProcess], timeout_s: float) -> dict[str, float]:
    """Block until every server serves `GET /v1/models`, polling them in turn (a failure is seen as soon as
    it happens, whichever server it is); returns each one's seconds until it served.

    Raises:
        ServerStartError: one exited first, or `timeout_s` passed (the processes are left running: `stop()`
            them).
    """
    start = time.monotonic()
    ready: dict[str, float] = {}
    while True:
        for server in servers:
            if server.name not in ready and server.poll_ready():
                ready[server.name] = round(time.monotonic() - start, 1)
        if len(ready) == len(servers):
            return ready
        if time.monotonic() - start > timeout_s:
            late = next(s for s in servers if s.name not in ready)
            raise late._failure(f"did not serve /v1/models within {timeout_s:.0f} s")
        time.sleep(0.5)


def python_module_server(
    name: str, module: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
) -> ServerProcess:
    """`python -m MODULE ARGS --port P` (this interpreter, run from the repository) on a free port P,
    logging to LOG_DIR/NAME.log; not started."""
    port = free_port()
    argv = [sys.executable, "-m", module, *args, "--port", str(port)]
    return ServerProcess(name, argv, port, log_dir / f"{name}.log", env, str(ROOT))


def interrupt_on_sigterm():
    """Make SIGTERM raise KeyboardInterrupt in this process (so the caller's cleanup stops its servers);
    returns the previous handler, to restore with `signal.signal(signal.SIGTERM, previous)`."""

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, on_sigterm)
