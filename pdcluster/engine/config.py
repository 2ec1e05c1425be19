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

    Attributes:
        model: checkpoint directory (Hugging Face format).
        device: `cpu`, `cuda[:i]` or `npu[:i]`; nothing else in the engine names a device.
        dtype: parameter dtype name (`float32`, `bfloat16`, `float16`).
        block_size: token slots per KV cache block.
        num_kv_blocks: KV cache blocks per layer; None sizes the cache from `kv_cache_memory_bytes`.
        kv_cache_memory_bytes: bytes for all layers' KV cache when `num_kv_blocks` is None.
        kv_cache_dtype: `auto` (model dtype) or `int8` (per-token scales, folded into attention).
        kv_precision: KV dtype by request length (`engine.kv_precision`, one block pool per precision,
            `engine.kv_pools`); None: every request in `kv_cache_dtype`. Needs `kv_cache_dtype` auto.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes + drafts).
        max_num_seqs: running requests at most.
        max_model_len: context length; None means the model's `max_position_embeddings`.
        enable_prefix_caching: reuse KV of identical full prompt blocks across requests.
        enable_chunked_prefill: split long prompts over several steps under the token budget.
        num_speculative_tokens: MTP draft tokens per step, k (0 disables speculative decoding).
        adaptive_speculation: shrink/grow k in [1, num_speculative_tokens] from the recent acceptance rate
            (`engine.spec_policy`); a no-op when num_speculative_tokens is 0. Not with `async_scheduling`:
            there step N+1's draft slots are fixed before step N's verification is known, so a smaller k
            would only be padded back to the maximum with filler drafts (ValueError).
        adaptive_speculation_min_accept_prob: the probability of reaching and accepting a draft below which
            adaptive speculation stops drafting that deep (the cost of one more verified draft, in tokens).
        async_scheduling: prepare step N+1 on the CPU while step N's forward runs (`engine.async_loop`);
            greedy outputs are identical to the synchronous loop, with or without speculative decoding.
            Not with expert parallelism (ValueError): every EP rank must join each step's MoE collectives
            in the same order, which the pipelined loop's worker thread does not guarantee.
        parallel: the instance's parallel layout as seen by this rank (`engine.parallel.ParallelConfig`);
            the default is one device.
        compile: compile the decode forward at load over padded batch-size buckets up to `max_num_seqs`
            (`engine.compiled_forward`: torch.compile; CUDA graphs on cuda); uniform decode steps run it,
            others run eagerly; prefill and mixed steps of 2 to `compiled_prefill.DEFAULT_MAX_NUM_TOKENS`
            tokens run a compiled ragged-batch forward (`engine.compiled_prefill`, one graph for all of
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
