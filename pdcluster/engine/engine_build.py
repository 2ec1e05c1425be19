"""Builds an engine's KV cache, scheduler and executor from its `EngineConfig`."""

from __future__ import annotations

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.executor import Executor
from pdcluster.engine.kv_pool_attention import KVPoolCaches
from pdcluster.engine.kv_pools import KVPoolLayout, PooledBlockManager
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.request import Request
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.scheduler_policy import SchedulerConfig
from pdcluster.engine.structured_output import StructuredOutputs
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.tokenizer import Tokenizer


def build_kv_and_scheduler(
    config: EngineConfig, model: DeepseekV3ForCausalLM, max_model_len: int, shared_kv_cache: bool
) -> tuple[KVPoolLayout | None, ModelRunner, Scheduler]:
    """The KV pool layout (None without `kv_precision`), the model runner with its KV cache, the scheduler."""
    model_cfg = model.config
    num_blocks = config.num_kv_blocks
    kv_layout = _kv_layout(config, model)
    if kv_layout is not None:
        num_blocks = sum(kv_layout.num_blocks_per_pool)
    elif num_blocks is None:
        probe = ModelRunner(model, 1, config.block_size, config.kv_cache_dtype)
        num_blocks = max(
            1, config.kv_cache_memory_bytes // (probe.kv_cache_bytes_per_token * config.block_size)
        )
    runner = ModelRunner(
        model,
        1 if kv_layout else num_blocks,
        config.block_size,
        config.kv_cache_dtype,
        shared_kv_cache and kv_layout is None,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_tokens=max(0, config.num_speculative_tokens - 1),
        ),
        num_blocks,
        config.enable_prefix_caching,
        num_draft_placeholders=config.num_speculative_tokens if config.async_scheduling else 0,
    )
    if kv_layout is not None:
        counts = kv_layout.num_blocks_per_pool
        scheduler.block_manager = PooledBlockManager(counts, config.block_size, config.enable_prefix_caching)
        runner.kv_caches = runner.kv_scales = []
        runner.num_blocks = num_blocks
        runner.kv_pools = KVPoolCaches(
            kv_layout.pools, counts, config.block_size, model_cfg.kv_cache_dim, runner.device
        )
    return kv_layout, runner, scheduler


def build_executor(
    config: EngineConfig, runner: ModelRunner, scheduler: Scheduler, tokenizer: Tokenizer
) -> Executor:
    """The executor over the runner, its input buffers sized by the scheduler's limits."""
    model_cfg = runner.model.config
    return Executor(
        runner,
        config.num_speculative_tokens,
        max_num_tokens=config.max_num_batched_tokens,
        max_num_reqs=config.max_num_seqs,
        max_num_blocks_per_req=scheduler.request_rows.table.shape[1],
        adaptive_min_accept_prob=config.adaptive_speculation_min_accept_prob
        if config.adaptive_speculation
        else None,
        structured_outputs=StructuredOutputs(tokenizer, model_cfg.vocab_size),
    )


def _kv_layout(config: EngineConfig, model: DeepseekV3ForCausalLM) -> KVPoolLayout | None:
    cfg = model.config
    if config.kv_precision is None:
        return None
    return KVPoolLayout.build(
        config.kv_precision,
        len(model.main_layers) + len(model.mtp_layers),
        next(model.parameters()).dtype,
        cfg.kv_cache_dim,
        config.block_size,
        config.kv_cache_memory_bytes,
        config.num_kv_blocks,
    )


def assign_kv_pool(layout: KVPoolLayout | None, request: Request, max_tokens: int, block_size: int) -> None:
    """Admission: the request's KV pool from its band (`engine.kv_precision`).
    Raises ValueError: the request could never fit that pool."""
    if layout is None:
        return
    request.kv_pool = layout.pool_for(request.num_prompt_tokens, max_tokens)
    num_blocks = -(-(request.num_prompt_tokens + max_tokens) // block_size)
    if num_blocks > layout.num_blocks_per_pool[request.kv_pool]:
        raise ValueError(
            f"prompt + max_tokens needs {num_blocks} KV blocks, its KV pool "
            f"{request.kv_pool} holds {layout.num_blocks_per_pool[request.kv_pool]}"
        )
