"""Engine arguments: one frozen dataclass, field names as in vLLM where the concept is the same."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.engine.kv_precision import KVPrecisionPolicy
from pdcluster.engine.parallel import ParallelConfig
from pdcluster.models.dtypes import MODEL_DTYPE_NAMES, MODEL_DTYPES

KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance (a prefill or decode node runs one).

    dtype: parameter dtype name (`float32`, `bfloat16`, `float16`).
    kv_cache_dtype: `auto` (model dtype) or `int8` (per-token scales, folded into attention).
    them), longer ones eagerly. Ignored (eager) with an int8 KV cache or expert parallelism.
    """

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    kv_cache_dtype: str = "auto"
    kv_precision: KVPrecisionPolicy | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    adaptive_speculation: bool = False
    adaptive_speculation_min_accept_prob: float = 0.3
    async_scheduling: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"engine argument {name!r}: {why} (got {getattr(self, name)!r})")

        if self.dtype not in MODEL_DTYPES:
            raise bad("dtype", f"must be one of {MODEL_DTYPE_NAMES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        if self.kv_precision is not None and self.kv_cache_dtype != "auto":
            raise bad("kv_cache_dtype", "must be auto with kv_precision (the policy picks each request's)")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_memory_bytes"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "must be >= 1 or None")
        if self.num_speculative_tokens < 0:
            raise bad("num_speculative_tokens", "must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be >= 1 or None")
        if not 0 < self.adaptive_speculation_min_accept_prob <= 1:
            raise bad("adaptive_speculation_min_accept_prob", "must be in (0, 1]")
        if self.async_scheduling and self.parallel.enabled:
            raise bad(
                "async_scheduling",
                "is not supported with expert parallelism (parallel.expert_parallel_size > 1): the EP ranks "
                "must run each step's MoE collectives in lockstep on the calling thread",
            )
        if self.adaptive_speculation and self.async_scheduling and self.num_speculative_tokens:
            raise bad(
                "adaptive_speculation",
                "is not supported with async_scheduling (step N+1's draft slots are fixed before step N's "
                "acceptance is known)",
            )
