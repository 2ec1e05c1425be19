"""What `pdcluster deploy` checks before it starts Ray, beyond the topology file's own rules.

`pdcluster validate --for-deploy FILE` reports exactly these, at the lines of the keys they concern;
`pdcluster deploy` refuses a file with any of them (one `FILE:LINE: reason` line each, exit code 2) before
it connects to or starts Ray. Plain `pdcluster validate` checks a file as a plan only (it may describe
hardware this machine is not) and prints the actor-layer and weight-dtype limits below as notes.

- The actor layer runs one rank actor per device with data-parallel attention, routed experts split over
  every rank of the instance (EP) or replicated on each (`actor_layer_issues`): tensor-parallel attention
  and experts split over part of an instance are valid plans that deploy cannot run.
- The weight dtype (`weight_dtype_issues`): the engine loads weights in `model.dtype`; a
  `model.weight_dtype` that resolves to another dtype (8-bit weights) is a valid plan deploy cannot run.
- The checkpoint as this machine sees it (`checkpoint_issues`): `config.json`, the safetensors files and
  their headers (none truncated), every tensor present with its shape, `tokenizer.json`
  (`models.loader.check_checkpoint_dir`; no tensor data is read). The driver reads the tokenizer from the
  same path, so deploy needs it readable where it runs.
- The HTTP address (`bind_problem`): `api.host:api.port` (or `--port`) can be bound now. `serve` binds
  it again before Ray starts and holds it while the actors load (`api.server.bind_server_socket`).
"""

from __future__ import annotations

import errno
import socket

from pdcluster.orchestrator.topology import ROLES, Issue, ModelConfig, PoolConfig, Topology

MAX_REASON_CHARS = 600  # a reason longer than this (a list of 50 missing tensors) is cut, saying so


def one_line(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text` on one line: its lines joined by "; " (indentation dropped), cut to about `limit` characters
    with the number of characters left out."""
    joined = "; ".join(part.strip() for part in str(text).splitlines() if part.strip())
    joined = joined.replace(":; ", ": ")
    if len(joined) <= limit:
        return joined
    return f"{joined[:limit]}... ({len(joined) - limit} more characters)"


def pool_parallelism(role: str, pool: PoolConfig) -> str | None:
    """`"prefill: 32 devices, EP32"` for a pool whose instances need more than one device (or TP/EP > 1),
    None for a pool of single-device instances."""
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
    """What the actor layer cannot run, one issue per pool at the key it concerns. An instance of N devices
    runs N rank actors with data-parallel attention; its routed experts are either split over all N ranks
    (`expert_parallel_size` N, EP) or replicated on each (`expert_parallel_size` 1). Refused:
    `tensor_parallel_size` > 1 (tensor-parallel attention), and 1 < `expert_parallel_size` < N (each
    expert's FFN split over the rest, `moe_tensor_parallel_size` > 1)."""
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
    """`model.weight_dtype` when it resolves to another dtype than `model.dtype`: the engine loads the
    checkpoint's weights in `model.dtype` and has no 8-bit GEMMs, so another weight dtype is a planning
    assumption (`planner.memory`, `planner.perf_model`) that deploy cannot run. At most one issue, at
    `model.weight_dtype`."""
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


def checkpoint_issues(model: ModelConfig) -> list[Issue]:
    """The checkpoint directory `model.checkpoint_dir` as `LLMEngine` will load it; at most one issue (at
    `model.path`), its reason on one line."""
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
    """Why the HTTP server could not bind `host:port` (TCP, IPv4, SO_REUSEADDR as the server does) right
    now, as (the `api` key it concerns, reason), or None. Port 0 checks the host only. Binds and closes at
    once; resolves `host` if it is a name.
    """
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
    """Every reason `pdcluster deploy` would refuse a valid `topology` on this machine now.

    Args:
        port: the `--port` override of `api.port` (its issue has no line in the file: path `()`).

    Returns:
        issues at the key paths they concern: `actor_layer_issues`, `weight_dtype_issues`,
        `checkpoint_issues` and the bind check of `api.host` and the port (in use or no permission: at
        `api.port`; otherwise at `api.host`).
    """
    issues = actor_layer_issues(topology) + weight_dtype_issues(topology) + checkpoint_issues(topology.model)
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
