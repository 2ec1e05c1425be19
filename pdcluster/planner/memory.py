"""Parameters each device of an instance holds, for a DeepSeek-V3-architecture config: does a split fit?

Pure arithmetic over `models.config.DeepseekV3Config` (field names are the public `config.json` keys).
Parameter layout: DeepSeek-V3 technical report (arXiv 2412.19437) section 2.1 (MLA, DeepSeekMoE), 2.2
(MTP), 4.2 (hyper-parameters: 61 layers, the first 3 dense, 1 shared + 256 routed experts, 1 MTP module);
the tensors are those of `models.deepseek_v3` (the public checkpoint's names).

Per device of an instance of `devices` devices, `tp = tensor_parallel_size`, `ep = expert_parallel_size`,
`moe_tp = devices / ep` (symbols as in `planner.op_costs`: h `hidden_size`, H heads, V `vocab_size`,
r `kv_lora_rank`, dr `qk_rope_head_dim`, dn `qk_nope_head_dim`, dv `v_head_dim`, qr `q_lora_rank`,
mi `moe_intermediate_size`, E `n_routed_experts`, L `num_hidden_layers`, K `first_k_dense_replace`,
M `num_nextn_predict_layers`):

* on every device (attention data-parallel when tp == 1):
    embedding `V h`, lm_head `V h` (none with `tie_word_embeddings`), final norm `h`;
    per layer (L main + M MTP), MLA: `q_a h qr` + its norm `qr` + `q_b qr (H/tp)(dn + dr)` (or
    `q_proj h (H/tp)(dn + dr)` when `q_lora_rank` is null), `kv_a h (r + dr)` + its norm `r`,
    `kv_b r (H/tp)(dn + dv)`, `o (H/tp) dv h`, and the two layer norms `2 h` (tp splits the heads, as
    `planner.op_costs.attention_projections` does; `q_a`/`kv_a` stay whole);
    dense MLP of the first K layers `3 h inter / tp`; per MoE layer (layer index >= K: L - K main + M
    MTP, `DeepseekV3Config.is_moe_layer`) the gate `E h`
    and the shared expert(s) `3 h mi n_shared / tp`;
    per MTP module `eh_proj 2h h` and its norms `enorm`, `hnorm`, `shared_head.norm` (`3 h`); its
    embedding and output head are the main model's (the public checkpoint stores copies under the MTP
    layer, which `models.loader` skips).
* routed experts, per MoE layer (main and MTP alike): `ceil((E + num_redundant_experts) / ep)` experts
  of `3 h mi` parameters each, each split over `moe_tp` devices: `ceil(3 h mi / moe_tp)`.

DeepSeek-V3 in these terms: 671.0B parameters in the main model and 11.6B in the MTP module (without
its embedding/head copies: the Hugging Face card's 685B = 671B + 14B counts them). Buffers (the router's
`e_score_correction_bias`, RoPE tables) are not parameters and are not counted (E float32 per MoE layer).

Bytes: every parameter in the weight dtype (`planner.op_costs.dtype_bytes`: bf16 2 B, int8/fp8 1 B).
The norms and the router gate, which 8-bit checkpoints keep in 16 bits, are charged at the weight dtype
too (~0.1 GB per device for DeepSeek-V3), and quantization scales are not counted. Weights plus
`kv_cache_memory_bytes` is thus a lower bound of what a device needs: activations, workspaces and
communication buffers come on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from pdcluster.engine.kv_precision import KVPrecisionPolicy, admission_length
from pdcluster.models.config import DeepseekV3Config
from pdcluster.planner.op_costs import dtype_bytes, kv_bytes_per_token_per_layer

if TYPE_CHECKING:
    from pdcluster.orchestrator.hardware import AcceleratorSpec
    from pdcluster.orchestrator.topology import PoolConfig

GB = 1e9  # for messages


@dataclass(frozen=True)
class ResidentParams:
    """Parameters one device of an instance holds, by part (counts of elements, not bytes).

    Attributes:
        embedding: token embedding `[V, h]`, plus the final norm `[h]`.
        lm_head: output head `[V, h]` (0 when tied to the embedding).
        attention: MLA projections and their two latent norms, every layer (main and MTP), the TP share.
        layer_norms: input and post-attention norms of every layer (main and MTP).
        dense_mlp: the SwiGLU MLPs of the first `first_k_dense_replace` layers, the TP share.
        moe_gates: the routers `[E, h]` of every MoE layer (main and MTP).
        shared_experts: the shared experts of every MoE layer, the TP share.
        mtp_extra: per MTP module `eh_proj [h, 2h]` and the norms `enorm`, `hnorm`, `shared_head.norm`.
        routed_experts: the routed experts this device holds over all MoE layers (its EP and MoE-TP share).
        experts_per_layer: routed experts (logical + redundant copies) on this device per MoE layer.
    """

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
        """Every part but the routed experts: what each device holds whatever the EP degree."""
        return self.total - self.routed_experts

    @property
    def total(self) -> int:
        """All parameters on the device."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "experts_per_layer")

    def bytes(self, weight_dtype: str) -> int:
        """Bytes of `total` parameters in `weight_dtype` (e.g. bfloat16, int8; see the module docstring)."""
        return self.total * dtype_bytes(weight_dtype, "weight dtype")


def resident_params(
    cfg: DeepseekV3Config,
    devices: int = 1,
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    num_redundant_experts: int = 0,
) -> ResidentParams:
    """The parameters one device of an instance of `devices` devices holds (formula: module docstring).

    Raises:
        ValueError: a parallel size < 1, or one that does not divide `devices`.
    """
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
    """`resident_params` of one device of one instance of `pool` (a topology's prefill or decode pool)."""
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
    """Why one device of `pool` cannot hold its parameters (`pool_resident_params`) in `weight_dtype` plus
    the pool's `kv_cache_memory_bytes` in `spec.hbm_bytes`, or None when they fit, e.g. `(EP32, 9 routed
    experts per device per MoE layer): 81.7 GB of bfloat16 weights + 8.6 GB of KV cache per device > 68.7 GB
    of one ascend-910c device` (GB = 1e9 bytes).

    Raises:
        ValueError: an unknown `weight_dtype`, parallel sizes that do not divide the instance.
    """
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
