"""The engine arguments of one instance's ranks, derived from its pool by field name.

Every `EngineConfig` field named like a field of the pool (`block_size`, `kv_cache_dtype`, `max_num_seqs`,
`enable_chunked_prefill` on prefill, `adaptive_speculation` on decode, ...) takes the pool's value; the few
that come from elsewhere (the rank's `parallel` layout among them) are written out in `engine_arguments`;
the rest are left at the engine's default, listed per role in `ENGINE_DEFAULTED`. A test checks that these
three cover every `EngineConfig` field and every pool field is an engine argument or in
`POOL_DEPLOYMENT_FIELDS`, so a field added to either side is passed down or deliberately left out, never
dropped silently.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.parallel import ParallelConfig

if TYPE_CHECKING:
    from pdcluster.orchestrator.topology.schema import Topology

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))

# Pool fields that size and place the pool (instances, their devices, parallelism) or that the driver
# applies (the engine watchdog): not engine arguments.
POOL_DEPLOYMENT_FIELDS = frozenset(
    {
        "num_instances",
        "devices_per_instance",
        "span_nodes",
        "tensor_parallel_size",
        "expert_parallel_size",
        "num_redundant_experts",
        "eplb_interval_steps",
        "engine_watchdog_s",
    }
)

# EngineConfig fields no topology key sets, per role: the engine's own knobs, and on each pool the field only
# the other pool has (chunked prefill is prefill's, adaptive speculation decode's).
# (`parallel`, engine.parallel.ParallelConfig, is per rank: `engine_arguments(topology, role, rank)` derives
# it, `parallel_config`.)
_ENGINE_ONLY = frozenset({"num_kv_blocks", "adaptive_speculation_min_accept_prob", "async_scheduling"})
ENGINE_DEFAULTED = {
    "prefill": _ENGINE_ONLY | {"adaptive_speculation"},
    "decode": _ENGINE_ONLY | {"enable_chunked_prefill"},
}


def parallel_config(topology: Topology, role: str, rank: int = 0) -> ParallelConfig:
    """The `engine.parallel.ParallelConfig` of rank `rank` of an instance of pool `role`.

    Routed experts split over every rank (`expert_parallel_size == devices_per_instance > 1`): that
    size and rank, the pool's `num_redundant_experts` and `eplb_interval_steps`, EPLB's nodes (the whole
    nodes a spanning instance takes, else 1), and collectives that wait at most
    `orchestrator.dispatch.collective_timeout_s(kv_transfer.timeout_s)`. Otherwise (one device, or
    experts replicated on every rank: `expert_parallel_size` 1) one device's: each rank runs on its own.

    Raises:
        ValueError: `role` is neither `prefill` nor `decode`, or the engine refuses the layout.
    """
    from pdcluster.orchestrator.dispatch import collective_timeout_s

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
    """`EngineConfig` keyword arguments for rank `rank` of one instance of pool `role` (`prefill` or
    `decode`).

    From the pool: every field of the same name (`kv_cache_memory_bytes` is per device; `max_num_seqs`
    and `max_num_batched_tokens` are per instance, so each of its data-parallel attention ranks gets
    `ceil(value / attention_data_parallel_size)`). From elsewhere:
    `model` (the checkpoint directory), `device` (the accelerator's torch device type; the device index is
    the actor's to add), `dtype` (`ModelConfig.resolved_dtype`), `num_speculative_tokens` from decode
    for both pools (prefill drafts the first MTP tokens that travel with the KV), `parallel`
    (`parallel_config`: the rank's expert-parallel layout), `compile` (`Topology.compiles`: the
    decode pool's null default resolved by the accelerator) and `kv_precision` (the topology's, both pools).

    Raises:
        ValueError: `role` is neither `prefill` nor `decode`.
    """
    pool = topology.pool(role)
    spec = topology.hardware.spec
    arguments = {f.name: getattr(pool, f.name) for f in dataclasses.fields(pool) if f.name in ENGINE_FIELDS}
    # The pool's step budget and running-request limit are per instance (as the planner simulates them);
    # with data-parallel attention each rank's engine takes its share, rounded up.
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
