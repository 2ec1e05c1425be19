"""How rank actors are made and judged at deploy: their Ray class and options, when Ray restarts them, how
long deploy waits for them, and the topologies deploy refuses.
"""

from __future__ import annotations

from typing import Any

from pdcluster.config import ADDRESSED_KV_TRANSPORTS, Topology
from pdcluster.config.preflight import actor_layer_issues, weight_dtype_issues
from pdcluster.driver.messages import NodeReady

MAX_ACTOR_RESTARTS = 5  # Ray restarts a crashed actor (grpc, shm) this often; then it stays dead
# Health probes get their own Ray concurrency group, so calls hung on the engine cannot starve them.
PROBE_GROUP = "probe"
PROBE_GROUPS = {PROBE_GROUP: 2}


def rank_actor_class(ray, cls: type) -> Any:
    """The Ray actor class of rank class `cls` (`PrefillWorker`, `DecodeWorker`), with the probe group:
    every rank actor must be made by it, since a call to a group the actor lacks crashes its process."""
    return ray.remote(concurrency_groups=PROBE_GROUPS)(cls)


def ray_restarts(kv_transport: str, num_ranks: int) -> bool:
    """Whether Ray restarts a dead rank's actor: instances deployed with one rank, on grpc or shm."""
    return kv_transport in ADDRESSED_KV_TRANSPORTS and num_ranks == 1


ACTORS_READY_TIMEOUT_S = 300.0
# Seconds more deploy waits for the ranks of a pool with `compile` on (the decode forward compiles at load).
COMPILE_READY_TIMEOUT_S = 600.0


def ready_timeout_s(topology: Topology) -> float:
    """Seconds deploy waits for each rank actor to be ready (and ranks for each other at their rendezvous):
    ACTORS_READY_TIMEOUT_S, plus COMPILE_READY_TIMEOUT_S when a pool compiles at load."""
    compiles = topology.compiles("prefill") or topology.compiles("decode")
    return ACTORS_READY_TIMEOUT_S + (COMPILE_READY_TIMEOUT_S if compiles else 0.0)


def load_summary(info: NodeReady) -> str:
    """How a rank's load went, for deploy's log: its load time and what `compile` did (compiled in how long,
    or why the rank runs eagerly).
    """
    stats = info.compile
    if stats is None or not stats.requested:
        return f"weights loaded in {info.load_s:.1f} s"
    if stats.compiled:
        return f"loaded in {info.load_s:.1f} s, the decode forward compiled in {stats.compile_s:.1f} s"
    return f"loaded in {info.load_s:.1f} s; compile is on but the decode forward runs eagerly: {stats.error}"


def check_deployable_parallelism(topology: Topology) -> None:
    """Raise ValueError, naming the keys, for parallelism the actor layer cannot run
    (`config.preflight.actor_layer_issues`)."""
    issues = actor_layer_issues(topology)
    if issues:
        raise ValueError(
            "; ".join(i.reason for i in issues) + " (`pdcluster validate` checks such a file as a plan only)"
        )


def check_deployable(topology: Topology) -> None:
    """`check_deployable_parallelism`, then a `model.weight_dtype` the engine does not run
    (`config.preflight.weight_dtype_issues`: 8-bit weights are a planning assumption): ValueError
    naming the key, as `pdcluster deploy` refuses it at its YAML line.
    """
    check_deployable_parallelism(topology)
    issues = weight_dtype_issues(topology)
    if issues:
        raise ValueError("; ".join(i.reason for i in issues))


def is_loopback_topology(topology: Topology) -> bool:
    """A single-node `cpu` topology: every transport endpoint stays on 127.0.0.1."""
    return topology.hardware.spec.ray_resource is None and topology.hardware.num_nodes == 1


def actor_resource_options(ray_resource: str | None) -> dict[str, Any]:
    """The device part of an actor's Ray options: `num_gpus=1` for GPUs (Ray refuses "GPU" in `resources`),
    `resources={"NPU": 1}` for custom accelerators, nothing on `cpu`.
    """
    if ray_resource is None:
        return {}
    if ray_resource == "GPU":
        return {"num_gpus": 1}
    return {"resources": {ray_resource: 1}}
