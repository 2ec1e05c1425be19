"""Errors out of deploying and calling Ray actors, described in one line for a person or a client.

`DeployError` (deploy failed after it started), `InstanceGroupFailed` (a multi-rank instance's group
broke), `EngineFailed` (a rank's engine thread died or is stuck), `actor_error_message` (the exception an
actor method or `__init__` raised, without Ray's traceback and ids) and `describe_error` (any error on the
request path).
"""

from __future__ import annotations

import re

from pdcluster.orchestrator.preflight import one_line


class InstanceGroupFailed(RuntimeError):
    """A rank reports that its instance group failed (`instance_group_error` in its load: a collective
    timed out or broke because a peer rank died or stalled): the instance can never step again, so the
    driver takes it out of routing as dead, like an actor that died."""


class EngineFailed(RuntimeError):
    """A rank's engine thread died, or is stuck in one pass of its loop past the pool's `engine_watchdog_s`
    (`orchestrator.health.engine_fault`), while the actor still answers calls: the instance is failed as
    if its actor had died. `pid`: the process of the instance's leader (rank 0), by which the health
    monitor kills the instance's actors once per incarnation, for Ray to restart, where Ray restarts them."""

    def __init__(self, message: str, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


class DeployError(RuntimeError):
    """`Cluster.deploy` (or `serve`) failed after it started: an actor did not start (its own exception,
    named, e.g. a CheckpointError from loading weights), a Ray call failed, the HTTP server could not
    bind. The message is one line; everything started is torn down before it is raised."""


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _raised_in_traceback(text: str) -> str | None:
    """The exception a formatted Python traceback in `text` ends with (`Type: message`, the module path of
    the type dropped), or None when `text` holds no traceback frame."""
    lines = _ANSI_ESCAPE.sub("", text).splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return None
    rest = lines[frames[-1] + 1 :]
    while rest and rest[0].startswith("    "):  # the frame's source line and caret annotation
        rest = rest[1:]
    raised = one_line("\n".join(rest))
    return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", raised) or None


def actor_error_message(exc: BaseException) -> str:
    """One line for an exception out of a Ray call, without Ray's traceback or the actor's ids.

    The exception raised inside the actor or task as `Type: message`: a RayTaskError's cause (also when Ray
    raises it as the dual `RayTaskError(X)`), or, for an actor whose `__init__` raised (Ray 2.60 raises an
    ActorDiedError that keeps only the formatted traceback), the exception that traceback ends with. Else
    Ray's own message without the lines that only identify the actor (ids, pid, node IP).
    """
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
    """A one-line description of `exc` fit for a client, for errors on the request path: an exception a
    remote method raised is described by itself (`actor_error_message`); Ray's own errors, which carry
    actor ids, process ids and node IPs, become what happened."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):  # the method raised: describe its own exception
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
