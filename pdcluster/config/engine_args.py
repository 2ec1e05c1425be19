"""The engine arguments of one instance's ranks, derived from its pool by field name.

A test checks that every `EngineConfig` field is taken from the pool, set in `engine_arguments` or listed
in `ENGINE_DEFAULTED`, and every pool field is an engine argument or in `POOL_DEPLOYMENT_FIELDS`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.parallel import ParallelConfig

if TYPE_CHECKING:
    from pdcluster.config.schema import Topology

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))

# Pool fields that size and place the pool or that the driver applies: not engine arguments.
POOL_DEPLOYMENT_FIELDS = frozenset(
    {
        "num_instances",
        "devices_per_instance",
        "span_nodes",
        "elastic_ep",
        "elastic_stall_s",
        "tensor_parallel_size",
        "expert_parallel_size",
        "num_redundant_experts",
        "eplb_interval_steps",
        "engine_watchdog_s",
    }
)

# EngineConfig fields no topology key sets, per role (`parallel` comes from `parallel_config`).
_ENGINE_ONLY = frozenset({"num_kv_blocks", "adaptive_speculation_min_accept_prob", "async_scheduling"})
ENGINE_DEFAULTED = {
    "prefill": _ENGINE_ONLY | {"adaptive_speculation"},
    "decode": _ENGINE_ONLY | {"enable_chunked_prefill"},
}


def parallel_config(topology: Topology, role: str, rank: int = 0) -> ParallelConfig:
    """The `ParallelConfig` of rank `rank` of an instance of pool `role` (EP when experts span ranks).

    Raises ValueError for an unknown `role` or a layout the engine refuses.
    """
    from pdcluster.driver.dispatch import collective_timeout_s

    pool = topology.pool(role)
    size = pool.expert_parallel_size
    if size == 1 or size != pool.devices_per_instance:
        return ParallelConfig()
    dpn = topology.hardware.devices_per_node
    return ParallelConfig(
        expert_parallel_size=size,
        rank=rank,
        num_redundant_experts=pool.num_redundant_experts,
        eplb_interval_steps=pool.eplb_interval_steps,
        eplb_num_nodes=size // dpn if pool.span_nodes and size > dpn else 1,
        collective_timeout_s=collective_timeout_s(topology.kv_transfer.timeout_s),
    )


def engine_arguments(topology: Topology, role: str, rank: int = 0) -> dict[str, Any]:
    """`EngineConfig` keyword arguments for rank `rank` of an instance of pool `role`.

    Per-instance `max_num_seqs` and `max_num_batched_tokens` are divided (rounded up) over attention DP ranks;
    `kv_precision` is the topology's, for both pools. Raises ValueError for an unknown `role`.
    """
    pool = topology.pool(role)
    spec = topology.hardware.spec
    arguments = {f.name: getattr(pool, f.name) for f in dataclasses.fields(pool) if f.name in ENGINE_FIELDS}
    dp = pool.attention_data_parallel_size
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        arguments[name] = -(-arguments[name] // dp)
    arguments.update(
        model=str(topology.model.checkpoint_dir),
        device=spec.torch_device_type,
        dtype=topology.model.resolved_dtype(spec),
        num_speculative_tokens=topology.decode.num_speculative_tokens,
        parallel=parallel_config(topology, role, rank),
        compile=topology.compiles(role),
        kv_precision=None if topology.kv_precision is None else topology.kv_precision.policy(),
    )
    return arguments
