"""The engine arguments of one instance, derived from its pool by field name.

Every `EngineConfig` field named like a field of the pool (`block_size`, `kv_cache_dtype`, `max_num_seqs`,
`enable_chunked_prefill` on prefill, `adaptive_speculation` on decode, ...) takes the pool's value; the few
that come from elsewhere are written out in `engine_arguments`; the rest are left at the engine's default,
listed per role in `ENGINE_DEFAULTED`. A test checks that these three cover every `EngineConfig` field and
every pool field is an engine argument or in `POOL_DEPLOYMENT_FIELDS`, so a field added to either side is
passed down or deliberately left out, never dropped silently.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig

if TYPE_CHECKING:
    from orchestrator.topology.schema import Topology

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))

# Pool fields that size and place the pool (instances, their devices, parallelism): not engine arguments.
POOL_DEPLOYMENT_FIELDS = frozenset(
    {
        "num_instances",
        "devices_per_instance",
        "span_nodes",
        "tensor_parallel_size",
        "expert_parallel_size",
        "num_redundant_experts",
    }
)

# EngineConfig fields no topology key sets, per role: the engine's own knobs, and on each pool the field only
# the other pool has (chunked prefill is prefill's, adaptive speculation decode's).
# `parallel` (engine.parallel.ParallelConfig) is per rank: the deployment fills it in for each rank actor.
_ENGINE_ONLY = frozenset(
    {"num_kv_blocks", "adaptive_speculation_min_accept_prob", "async_scheduling", "parallel"}
)
ENGINE_DEFAULTED = {
    "prefill": _ENGINE_ONLY | {"adaptive_speculation"},
    "decode": _ENGINE_ONLY | {"enable_chunked_prefill"},
}


def engine_arguments(topology: Topology, role: str) -> dict[str, Any]:
    """`EngineConfig` keyword arguments for one instance of pool `role` (`prefill` or `decode`).

    From the pool: every field of the same name (`kv_cache_memory_bytes` is per device). From elsewhere:
    `model` (the checkpoint directory), `device` (the accelerator's torch device type; the device index is
    the actor's to add), `dtype` (`ModelConfig.resolved_dtype`), and `num_speculative_tokens` from decode
    for both pools: prefill drafts the first MTP tokens that travel with the KV.

    Raises:
        ValueError: `role` is neither `prefill` nor `decode`.
    """
    pool = topology.pool(role)
    spec = topology.hardware.spec
    arguments = {f.name: getattr(pool, f.name) for f in dataclasses.fields(pool) if f.name in ENGINE_FIELDS}
    arguments.update(
        model=str(topology.model.checkpoint_dir),
        device=spec.torch_device_type,
        dtype=topology.model.resolved_dtype(spec),
        num_speculative_tokens=topology.decode.num_speculative_tokens,
    )
    return arguments
