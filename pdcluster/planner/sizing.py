"""The scheduler limits and KV blocks of one simulated instance, as the live engine sizes them."""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.config import Topology
from pdcluster.engine.scheduler_policy import SchedulerConfig
from pdcluster.planner.sim_engine import num_kv_blocks


@dataclass(frozen=True)
class PoolSizing:
    """The scheduler limits and KV blocks of one simulated instance (built by `pool_sizing`)."""

    scheduler: SchedulerConfig
    num_blocks: int


def kv_cache_bytes_per_token(topology: Topology, role: str) -> int:
    """Bytes of KV cache one token occupies on one device of pool `role`, as `ModelRunner` sizes it."""
    import torch

    from pdcluster.config import read_model_architecture
    from pdcluster.kernels.kv_quant import kv_cache_bytes_per_token as bytes_per_token
    from pdcluster.models.dtypes import MODEL_DTYPES

    arch = read_model_architecture(topology.model)
    pool = topology.pool(role)
    if pool.kv_cache_dtype == "int8":
        dtype = torch.int8
    else:
        dtype = MODEL_DTYPES[topology.model.resolved_dtype(topology.hardware.spec)]
    return bytes_per_token(arch.kv_cache_dim, dtype, arch.num_hidden_layers)


def pool_sizing(topology: Topology, role: str, bytes_per_token: int | None = None) -> PoolSizing:
    """Scheduler limits and KV blocks of one instance of pool `role`, simulated as one engine over its DP
    ranks. Raises ValueError for an unreadable model config or limits the live scheduler refuses."""
    from pdcluster.config import read_model_architecture

    engine = topology.engine_config(role)
    pool = topology.pool(role)
    if bytes_per_token is None:
        bytes_per_token = kv_cache_bytes_per_token(topology, role)
    max_model_len = engine.max_model_len or read_model_architecture(topology.model).max_position_embeddings
    scheduler = SchedulerConfig(
        max_num_batched_tokens=pool.max_num_batched_tokens,  # the instance's, not one rank's share
        max_num_seqs=pool.max_num_seqs,
        block_size=engine.block_size,
        max_model_len=max_model_len,
        enable_chunked_prefill=engine.enable_chunked_prefill,
        num_lookahead_tokens=max(0, engine.num_speculative_tokens - 1),
    )
    per_device = num_kv_blocks(engine.kv_cache_memory_bytes, bytes_per_token, engine.block_size)
    return PoolSizing(scheduler, per_device * pool.attention_data_parallel_size)
