"""Errors out of deploying and calling Ray actors, described in one line for a person or a client."""

from __future__ import annotations

import re

from pdcluster.config.preflight import one_line


class InstanceGroupFailed(RuntimeError):
    """A rank reports its instance group failed: the instance is taken out of routing as dead."""


class EngineFailed(RuntimeError):
    """A rank's engine thread died or is stuck past `engine_watchdog_s`; `pid` is the leader's process."""

    def __init__(self, message: str, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


class DeployError(RuntimeError):
    """`Cluster.deploy` failed after it started; everything started is torn down first."""


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _raised_in_traceback(text: str) -> str | None:
    """The `Type: message` a formatted traceback in `text` ends with, or None."""
    lines = _ANSI_ESCAPE.sub("", text).splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return None
    rest = lines[frames[-1] + 1 :]
    while rest and rest[0].startswith("    "):
        rest = rest[1:]
    raised = one_line("\n".join(rest))
    return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", raised) or None


def actor_error_message(exc: BaseException) -> str:
    """One line for an exception out of a Ray call: the actor's own exception, without Ray's ids."""
    from ray.exceptions import RayActorError, RayError, RayTaskError

    cause: BaseException = exc
    for _ in range(8):  # a task error inside a task error: the innermost cause
        inner = getattr(cause, "cause", None) if isinstance(cause, RayTaskError) else None
        if not isinstance(inner, BaseException):
            break
        cause = inner
    if cause is not exc and not isinstance(cause, RayError):
        return f"{type(cause).__name__}: {one_line(str(cause))}"
    text = exc.error_msg if isinstance(exc, RayActorError) else str(exc)
    raised = _raised_in_traceback(str(text))
    if raised is not None:
        return raised
    kept = [line for line in str(text).splitlines() if line.strip() and not line.startswith("\t")]
    return f"{type(exc).__name__}: {one_line(chr(10).join(kept))}"


def describe_error(exc: BaseException) -> str:
    """A one-line description for a client; Ray's own errors lose their ids, pids and node IPs."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):
        return actor_error_message(exc)
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return "the actor is unavailable (restarting or unreachable)"
    if isinstance(exc, ray.exceptions.ActorDiedError):
        return "the actor process died"
    if isinstance(exc, ray.exceptions.RayActorError):
        return "the actor died or is unreachable"
    if isinstance(exc, TimeoutError) and isinstance(exc, ray.exceptions.RayError):
        return "no answer in time"
    if isinstance(exc, ray.exceptions.RayError):
        return f"Ray error ({type(exc).__name__})"
    text = one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
