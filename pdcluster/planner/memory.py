"""Parameters each device of an instance holds, for a DeepSeek-V3-architecture config: does a split fit?

Layout from the DeepSeek-V3 report (arXiv 2412.19437) sections 2.1-2.2 and 4.2: per device, embedding,
head and norms whole; attention, dense MLPs and shared experts split over tp; per MoE layer the gate and
`ceil((E + redundant) / ep)` routed experts, each split over `devices / ep`. Buffers and quantization
scales are not counted: weights + KV cache is a lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from pdcluster.engine.kv_precision import KVPrecisionPolicy, admission_length
from pdcluster.models.config import DeepseekV3Config
from pdcluster.planner.op_costs import dtype_bytes, kv_bytes_per_token_per_layer

if TYPE_CHECKING:
    from pdcluster.config import PoolConfig
    from pdcluster.config.hardware import AcceleratorSpec

GB = 1e9


@dataclass(frozen=True)
class ResidentParams:
    """Parameters (element counts, not bytes) one device of an instance holds, by part; `experts_per_layer` is
    the routed experts (logical + redundant) it holds per MoE layer."""

    embedding: int
    lm_head: int
    attention: int
    layer_norms: int
    dense_mlp: int
    moe_gates: int
    shared_experts: int
    mtp_extra: int
    routed_experts: int
    experts_per_layer: int

    @property
    def replicated(self) -> int:
        """Every part but the routed experts."""
        return self.total - self.routed_experts

    @property
    def total(self) -> int:
        """All parameters on the device."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "experts_per_layer")

    def bytes(self, weight_dtype: str) -> int:
        """Bytes of `total` parameters in `weight_dtype`."""
        return self.total * dtype_bytes(weight_dtype, "weight dtype")


def resident_params(
    cfg: DeepseekV3Config,
    devices: int = 1,
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    num_redundant_experts: int = 0,
) -> ResidentParams:
    """The parameters one device of an instance of `devices` devices holds. Raises ValueError for a parallel
    size < 1 or one that does not divide `devices`."""
    tp, ep = tensor_parallel_size, expert_parallel_size
    if min(devices, tp, ep) < 1 or devices % tp or devices % ep:
        raise ValueError(
            f"tensor_parallel_size {tp} and expert_parallel_size {ep} must be >= 1 and divide "
            f"devices {devices}"
        )
    h, heads = cfg.hidden_size, math.ceil(cfg.num_attention_heads / tp)
    num_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    num_moe = sum(cfg.is_moe_layer(i) for i in range(num_layers))
    num_dense = num_layers - num_moe

    if cfg.q_lora_rank is None:
        query = h * heads * cfg.qk_head_dim
    else:
        query = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * cfg.qk_head_dim
    key_value = (
        h * cfg.kv_cache_dim
        + cfg.kv_lora_rank
        + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    )
    output = heads * cfg.v_head_dim * h

    experts_per_layer = math.ceil((cfg.n_routed_experts + num_redundant_experts) / ep) if num_moe else 0
    expert = math.ceil(3 * h * cfg.moe_intermediate_size / (devices // ep))
    shared = 3 * h * math.ceil(cfg.moe_intermediate_size * cfg.n_shared_experts / tp)
    return ResidentParams(
        embedding=cfg.vocab_size * h + h,
        lm_head=0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
        attention=num_layers * (query + key_value + output),
        layer_norms=num_layers * 2 * h,
        dense_mlp=num_dense * 3 * h * math.ceil(cfg.intermediate_size / tp),
        moe_gates=num_moe * cfg.n_routed_experts * h,
        shared_experts=num_moe * shared,
        mtp_extra=cfg.num_nextn_predict_layers * (2 * h * h + 3 * h),
        routed_experts=num_moe * experts_per_layer * expert,
        experts_per_layer=experts_per_layer,
    )


def pool_resident_params(cfg: DeepseekV3Config, pool: PoolConfig) -> ResidentParams:
    """`resident_params` of one device of one instance of `pool`."""
    return resident_params(
        cfg,
        pool.devices_per_instance,
        pool.tensor_parallel_size,
        pool.expert_parallel_size,
        pool.num_redundant_experts,
    )


def pool_memory_overflow(
    cfg: DeepseekV3Config, pool: PoolConfig, spec: AcceleratorSpec, weight_dtype: str
) -> str | None:
    """Why one device of `pool` cannot hold its weights plus `kv_cache_memory_bytes`, or None when they fit.
    Raises ValueError for an unknown `weight_dtype` or parallel sizes that do not divide the instance."""
    params = pool_resident_params(cfg, pool)
    weight_bytes = params.bytes(weight_dtype)
    if weight_bytes + pool.kv_cache_memory_bytes <= spec.hbm_bytes:
        return None
    experts = params.experts_per_layer
    return (
        f"(EP{pool.expert_parallel_size}, {experts} routed expert{'s' if experts != 1 else ''} per device "
        f"per MoE layer): {weight_bytes / GB:.1f} GB of {weight_dtype} weights + "
        f"{pool.kv_cache_memory_bytes / GB:.1f} GB of KV cache per device > {spec.hbm_bytes / GB:.1f} GB of "
        f"one {spec.name} device"
    )


# ---- KV cache bytes and MTP acceptance by request length (`engine.kv_precision`) ---------------------
def kv_bytes_per_token_by_band(
    cfg: DeepseekV3Config, policy: KVPrecisionPolicy, model_dtype: str
) -> list[int]:
    """KV cache bytes one token of a request in each band occupies over the L + M cached layers: per
    layer `(r + dr) x dtype`, plus a float32 scale where the layer is int8 (`op_costs`)."""
    num_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return [
        sum(kv_bytes_per_token_per_layer(cfg, d) for d in band.layer_dtype_names(num_layers, model_dtype))
        for band in policy.bands
    ]


def request_kv_bytes(
    cfg: DeepseekV3Config,
    policy: KVPrecisionPolicy,
    model_dtype: str,
    num_prompt_tokens: int,
    max_tokens: int,
    block_size: int,
) -> int:
    """KV bytes a request holds at its longest (`prompt + max_tokens`, in whole blocks), in its band's
    dtypes: what admitting it takes from its pool."""
    length = admission_length(num_prompt_tokens, max_tokens)
    per_token = kv_bytes_per_token_by_band(cfg, policy, model_dtype)[policy.band_index(length)]
    return math.ceil(length / block_size) * block_size * per_token


def mtp_acceptance_for_request(
    acceptance_by_kv_dtype: dict[str, float],
    policy: KVPrecisionPolicy,
    num_prompt_tokens: int,
    max_tokens: int,
    default: float,
) -> float:
    """MTP acceptance of a request from its band's KV dtype: `acceptance_by_kv_dtype` as measured by
    `pdcluster accuracy` (its JSON's `mtp_acceptance_by_kv_dtype`), `default` for a dtype not measured.
    Lower-precision KV lowers acceptance (FP8 KV: 0.725 -> 0.630 in vLLM issue 55557)."""
    band = policy.bands[policy.band_index(admission_length(num_prompt_tokens, max_tokens))]
    return acceptance_by_kv_dtype.get(band.describe(), default)
