"""What `pdcluster deploy` checks before it starts Ray, beyond the topology file's own rules.

`pdcluster validate --for-deploy` reports these at their keys' lines: plans the actor layer cannot run,
an 8-bit weight dtype, the checkpoint as this machine sees it, and whether the HTTP address binds now.
"""

from __future__ import annotations

import errno
import socket

from pdcluster.config import ROLES, Issue, ModelConfig, PoolConfig, Topology

MAX_REASON_CHARS = 600


def one_line(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text` on one line ("; "-joined), cut to about `limit` characters, saying how many were cut."""
    joined = "; ".join(part.strip() for part in str(text).splitlines() if part.strip())
    joined = joined.replace(":; ", ": ")
    if len(joined) <= limit:
        return joined
    return f"{joined[:limit]}... ({len(joined) - limit} more characters)"


def pool_parallelism(role: str, pool: PoolConfig) -> str | None:
    """`"prefill: 32 devices, EP32"` for a multi-device pool, else None."""
    parts = []
    if pool.tensor_parallel_size > 1:
        parts.append(f"TP{pool.tensor_parallel_size}")
    if pool.expert_parallel_size > 1:
        parts.append(f"EP{pool.expert_parallel_size}")
    if pool.devices_per_instance == 1 and not parts:
        return None
    plural = "s" if pool.devices_per_instance != 1 else ""
    return ", ".join([f"{role}: {pool.devices_per_instance} device{plural}", *parts])


def actor_layer_issues(topology: Topology) -> list[Issue]:
    """Pools the actor layer cannot run: TP attention, or 1 < expert_parallel_size < devices per instance."""
    issues = []
    for role in ROLES:
        pool = topology.pool(role)
        described = pool_parallelism(role, pool)
        if pool.tensor_parallel_size > 1:
            issues.append(
                Issue(
                    (role, "tensor_parallel_size"),
                    f"{role}.tensor_parallel_size: tensor-parallel attention ({described}) is not supported "
                    "by `pdcluster deploy`: it runs attention data-parallel, one rank per device (set "
                    "tensor_parallel_size: 1)",
                )
            )
        elif 1 < pool.expert_parallel_size < pool.devices_per_instance:
            issues.append(
                Issue(
                    (role, "expert_parallel_size"),
                    f"{role}.expert_parallel_size: {pool.expert_parallel_size} of "
                    f"{pool.devices_per_instance} devices would split each expert's FFN over "
                    f"{pool.moe_tensor_parallel_size} devices, "
                    "which `pdcluster deploy` does not run: set it to devices_per_instance "
                    f"({pool.devices_per_instance}, experts split over every rank) or 1 (experts replicated)",
                )
            )
    return issues


def weight_dtype_issues(topology: Topology) -> list[Issue]:
    """A `model.weight_dtype` other than `model.dtype`: the engine has no 8-bit GEMMs."""
    model, spec = topology.model, topology.hardware.spec
    weight, engine = model.resolved_weight_dtype(spec), model.resolved_dtype(spec)
    if weight == engine:
        return []
    written = "" if model.dtype == engine else f" ({model.dtype} on {spec.name})"
    return [
        Issue(
            ("model", "weight_dtype"),
            f"model.weight_dtype: {weight} is not the dtype the engine runs: it loads the checkpoint's "
            f"weights in model.dtype, {engine}{written}, and {weight} weights are a planning assumption "
            f"only (set weight_dtype: auto or {engine} to deploy)",
        )
    ]


def autoscale_live_issues(topology: Topology) -> list[Issue]:
    """`autoscale.enabled` on a topology whose instances cannot change role in place
    (`driver.role_moves.movable_issue`): deploy refuses it rather than ignore it."""
    from pdcluster.driver.role_moves import movable_issue

    if not topology.autoscale.enabled:
        return []
    issue = movable_issue(topology)
    if issue is None:
        return []
    simulate = "simulate the controller with `pdcluster plan FILE --trace T --autoscale`"
    reason = f"autoscale.enabled: {issue}; {simulate}"
    return [Issue(("autoscale", "enabled"), reason)]


def checkpoint_issues(model: ModelConfig) -> list[Issue]:
    """The checkpoint as `LLMEngine` will load it; at most one issue, at `model.path`."""
    from pdcluster.models.loader import check_checkpoint_dir

    hint = ""
    if model.path is None:
        hint = " (the bundled checkpoint is written by `python -m pdcluster.models.train_tiny`)"
    try:
        check_checkpoint_dir(model.checkpoint_dir)
    except (OSError, ValueError) as exc:  # CheckpointError is a ValueError
        return [Issue(("model", "path"), f"model.path: {one_line(str(exc))}{hint}")]
    return []


def bind_problem(host: str, port: int) -> tuple[str, str] | None:
    """Why `host:port` cannot be bound now, as (the `api` key, reason), or None (port 0: the host only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            return "host", f"cannot resolve host {host!r} ({exc.strerror})"
        except OverflowError:
            return "port", f"port {port} is not in [0, 65535]"
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "port", f"{host}:{port} is already in use (another server, or a deploy still running?)"
            if exc.errno == errno.EACCES:
                return "port", f"no permission to bind {host}:{port} (ports below 1024 need privileges)"
            if exc.errno == errno.EADDRNOTAVAIL:
                return "host", f"{host} is not an address of this machine ({exc.strerror})"
            return "host", f"cannot bind {host}:{port}: {exc.strerror or exc}"
    return None


def deploy_issues(topology: Topology, *, port: int | None = None) -> list[Issue]:
    """Every reason `pdcluster deploy` would refuse `topology` here now; `port` overrides `api.port`."""
    issues = actor_layer_issues(topology) + weight_dtype_issues(topology) + checkpoint_issues(topology.model)
    issues += autoscale_live_issues(topology)
    api = topology.api
    effective_port = api.port if port is None else port
    problem = bind_problem(api.host, effective_port)
    if problem is not None:
        key, reason = problem
        if port is not None and key == "port":
            issues.append(Issue((), f"--port {port}: {reason}"))
        else:
            issues.append(Issue(("api", key), f"api.{key}: {reason}"))
    return issues
