"""FLOPs and bytes of each op of one engine step on one rank, for a DeepSeek-V3-architecture config.

Symbols: h hidden, H heads, r kv_lora_rank, dr/dn rope/nope head dims, dv v_head_dim. GEMM `[M, K] x [K, N]`:
`2 M K N` FLOPs. MLA (DeepSeek-V2, arXiv 2405.04434, section 2.1): n queries over c cached keys make
`n c + n (n + 1) / 2` causal pairs; expanded (prefill) `2 S r H (dn + dv) + 2 H pairs (dn + dr + dv)`,
absorbed (decode) `2 q H r (dn + dv) + 2 H pairs (2 r + dr)`. Routed experts (DeepSeek-V3 report,
section 2.1.2): weights read only for experts that get a token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdcluster.models.config import DeepseekV3Config

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}
INT8_SCALE_BYTES = 4  # float32 scale per int8 token (kernels.kv_quant)
OP_KINDS = ("gemm", "attention", "memory")


def dtype_bytes(name: str, what: str = "dtype") -> int:
    """Bytes per element of dtype `name`. Raises ValueError naming `what` for an unknown name."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"{what}: unknown dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def kv_bytes_per_token_per_layer(config: DeepseekV3Config, kv_dtype: str) -> int:
    """Bytes of one token's latent KV in one layer: `(r + dr) x dtype`, plus a float32 scale for int8."""
    scale = INT8_SCALE_BYTES if kv_dtype == "int8" else 0
    return config.kv_cache_dim * dtype_bytes(kv_dtype, "kv dtype") + scale


@dataclass(frozen=True)
class OpCost:
    """One op's work on one rank in one step: `kind` picks the roofline (`gemm`, `attention`, `memory`),
    `count` the layers it runs in, `gemms` its `(m, n, k, groups)`, `seq_len` attention's length."""

    name: str
    kind: str
    flops: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes: float = 0.0
    count: int = 1
    gemms: tuple[tuple[float, int, int, float], ...] = ()
    seq_len: float = 0.0

    @property
    def bytes(self) -> float:
        """All memory traffic of one run of the op."""
        return self.weight_bytes + self.activation_bytes + self.kv_bytes

    def times(self, count: int) -> OpCost:
        """The same op run `count` times."""
        return dataclasses.replace(self, count=count)


@dataclass(frozen=True)
class RankWork:
    """One rank's share of a step as the op counts need it (counts, >= 0): tokens, MLA queries/keys/causal
    pairs per form, lm_head rows, and the MTP layer's tokens and head rows."""

    num_tokens: float
    expanded_queries: float = 0.0
    expanded_keys: float = 0.0
    expanded_pairs: float = 0.0
    absorbed_queries: float = 0.0
    absorbed_keys: float = 0.0
    absorbed_pairs: float = 0.0
    logit_rows: float = 0.0
    mtp_tokens: float = 0.0
    mtp_logit_rows: float = 0.0


@dataclass(frozen=True)
class Dtypes:
    """Element dtypes of one deployment: `weight`, `activation`, `kv` (a model dtype or int8)."""

    weight: str = "bfloat16"
    activation: str = "bfloat16"
    kv: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("weight", "activation", "kv"):
            dtype_bytes(getattr(self, name), f"{name} dtype")


def gemm(name: str, m: float, k: int, n: int, weight_b: int, act_b: int) -> OpCost:
    """`[m, k] x [k, n]`: `2 m k n` FLOPs, `k n` weight elements, `m (k + n)` activation elements."""
    return OpCost(
        name, "gemm", 2.0 * m * k * n, float(k * n * weight_b), m * (k + n) * act_b, gemms=((m, n, k, 1.0),)
    )


def attention_projections(cfg: DeepseekV3Config, t: float, d: Dtypes, tp: int = 1) -> list[OpCost]:
    """MLA's projections for `t` tokens with heads split over `tp` ranks (`q_a`/`kv_a` replicated)."""
    wb, ab = dtype_bytes(d.weight), dtype_bytes(d.activation)
    h, heads = cfg.hidden_size, cfg.num_attention_heads // tp
    ops = []
    if cfg.q_lora_rank is None:
        ops.append(gemm("attn.q_proj", t, h, heads * cfg.qk_head_dim, wb, ab))
    else:
        ops.append(gemm("attn.q_a_proj", t, h, cfg.q_lora_rank, wb, ab))
        ops.append(gemm("attn.q_b_proj", t, cfg.q_lora_rank, heads * cfg.qk_head_dim, wb, ab))
    ops.append(gemm("attn.kv_a_proj_with_mqa", t, h, cfg.kv_cache_dim, wb, ab))
    ops.append(gemm("attn.o_proj", t, heads * cfg.v_head_dim, h, wb, ab))
    return ops


def attention_core(cfg: DeepseekV3Config, work: RankWork, d: Dtypes, tp: int = 1) -> list[OpCost]:
    """MLA attention of one layer, expanded and absorbed parts; the KV write goes to the first."""
    wb, ab = dtype_bytes(d.weight), dtype_bytes(d.activation)
    kv_tok = kv_bytes_per_token_per_layer(cfg, d.kv)
    heads, r, dr = cfg.num_attention_heads // tp, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    kv_b_weight = float(r * heads * (dn + dv) * wb)
    kv_write = work.num_tokens * kv_tok
    ops = []
    if work.expanded_queries:
        keys, pairs, q = work.expanded_keys, work.expanded_pairs, work.expanded_queries
        up_flops = 2.0 * keys * r * heads * (dn + dv)
        attn_flops = 2.0 * heads * pairs * (dn + dr) + 2.0 * heads * pairs * dv
        acts = 2.0 * keys * heads * (dn + dv) * ab + q * heads * (dn + dr + dv) * ab
        seq_len = 2.0 * pairs / q  # a causal chunk's full length, cache included
        expanded = OpCost(
            "attn.mla_expanded", "attention", up_flops + attn_flops, kv_b_weight, acts, keys * kv_tok
        )
        ops.append(dataclasses.replace(expanded, seq_len=seq_len))
    if work.absorbed_queries:
        keys, pairs, q = work.absorbed_keys, work.absorbed_pairs, work.absorbed_queries
        proj_flops = 2.0 * q * heads * dn * r + 2.0 * q * heads * r * dv
        attn_flops = 2.0 * heads * pairs * (r + dr) + 2.0 * heads * pairs * r
        acts = q * heads * (dn + dr + dv) * ab
        weight = 0.0 if work.expanded_queries else kv_b_weight
        ops.append(
            OpCost("attn.mla_absorbed", "attention", proj_flops + attn_flops, weight, acts, keys * kv_tok)
        )
    if ops:
        ops[0] = dataclasses.replace(ops[0], kv_bytes=ops[0].kv_bytes + kv_write)
    return ops


def mlp(
    name: str, t: float, h: int, inter: int, weight_b: int, act_b: int, weight_copies: float = 1.0
) -> OpCost:
    """SwiGLU over `t` tokens: `6 t h inter` FLOPs, `3 h inter` weights per copy."""
    groups = max(weight_copies, 1.0)
    m = t / groups
    return OpCost(
        name,
        "gemm",
        6.0 * t * h * inter,
        weight_copies * 3.0 * h * inter * weight_b,
        t * (2 * h + 3 * inter) * act_b,
        gemms=((m, 2 * inter, h, groups), (m, h, inter, groups)),
    )


def expected_active_experts(
    num_local_experts: float, num_experts: int, top_k: int, num_tokens: float
) -> float:
    """Local experts receiving at least one token under uniform top-k routing: `E_local (1 - (1 - k/E)^T)`."""
    if num_tokens <= 0 or num_local_experts <= 0:
        return 0.0
    return num_local_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def moe_ops(
    cfg: DeepseekV3Config,
    t_rank: float,
    routed_pairs_rank: float,
    active_experts_rank: float,
    d: Dtypes,
    moe_tp: int = 1,
    tp: int = 1,
) -> list[OpCost]:
    """One DeepSeekMoE layer on one rank: gate, routed experts (over `moe_tp`), shared (over `tp`)."""
    wb, ab = dtype_bytes(d.weight), dtype_bytes(d.activation)
    h, e = cfg.hidden_size, cfg.n_routed_experts
    mi = cfg.moe_intermediate_size
    ops = [gemm("moe.gate", t_rank, h, e, ab, ab)]
    routed = mlp("moe.routed_experts", routed_pairs_rank, h, mi // moe_tp, wb, ab, active_experts_rank)
    ops.append(routed)
    if cfg.n_shared_experts:
        ops.append(mlp("moe.shared_expert", t_rank, h, mi * cfg.n_shared_experts // tp, wb, ab))
    return ops


def elementwise(name: str, elements: float, act_b: int) -> OpCost:
    """Bandwidth-only work over `elements` activation elements."""
    return OpCost(name, "memory", 0.0, 0.0, elements * act_b)


def lm_head(cfg: DeepseekV3Config, rows: float, d: Dtypes, name: str = "lm_head") -> OpCost:
    """`[rows, h] x [h, V]`."""
    return gemm(name, rows, cfg.hidden_size, cfg.vocab_size, dtype_bytes(d.weight), dtype_bytes(d.activation))
