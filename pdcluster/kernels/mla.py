"""Multi-head Latent Attention (MLA) references: expanded (prefill) and weight-absorbed (decode).

Source: DeepSeek-V2 (arXiv 2405.04434) section 2.1; DeepSeek-V3 report section 2.1.1. The cache holds
`latent_kv = [c_kv (normalized); k_pe (rotated)]` per token; the absorbed form folds `W_UK` into the query
and `W_UV` into the output, so attention runs over the latent as multi-query attention.
"""

from __future__ import annotations

import functools

import torch


def split_kv_b_weight(
    kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_weight: [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]

    returns w_uk: [num_heads, qk_nope_head_dim, kv_lora_rank], w_uv: [num_heads, v_head_dim, kv_lora_rank]
    """
    kv_lora_rank = kv_b_weight.shape[-1]
    w = kv_b_weight.view(num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank)
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    softmax_scale: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    absorbed: bool = False,
) -> torch.Tensor:
    """MLA with keys/values up-projected from the latent (prefill), or over the latent with `W_UK`/`W_UV`
    absorbed (`absorbed`, decode): per head score = (q_nope W_UK) . kv_c + q_pe . k_pe, out = W_UV (p . kv_c).

    q_nope: [B, Sq, H, qk_nope_head_dim]; q_pe: [B, Sq, H, qk_rope_head_dim], rotated
    kv_c: [B, Sk, kv_lora_rank], normalized; k_pe: [B, Sk, qk_rope_head_dim], rotated, shared by all heads
    kv_b_weight: [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    attn_mask: [B, Sq, Sk] bool, True = may attend (else `is_causal` with Sq == Sk; ValueError otherwise)
    returns [B, Sq, H, v_head_dim] in `q_nope.dtype`
    """
    batch, num_q, num_heads, qk_nope_head_dim = q_nope.shape
    num_k = kv_c.shape[1]
    v_head_dim = kv_b_weight.shape[0] // num_heads - qk_nope_head_dim
    if is_causal and attn_mask is None and num_q != num_k:
        raise ValueError(f"is_causal needs as many queries as keys (got {num_q} and {num_k}); pass attn_mask")
    if not absorbed:
        kv = torch.nn.functional.linear(kv_c, kv_b_weight).view(batch, num_k, num_heads, -1)
        k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, :, None, :].expand(-1, -1, num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        mask = None if attn_mask is None else attn_mask[:, None, :, :]  # [B, 1, Sq, Sk]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, H, Sq, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=is_causal and mask is None,
            scale=softmax_scale,
        )
        return out.transpose(1, 2)  # [B, Sq, H, v_head_dim]
    w_uk, w_uv = split_kv_b_weight(kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
    q_latent = torch.einsum("bqhd,hdc->bqhc", q_nope, w_uk)  # [B, Sq, H, kv_lora_rank]
    scores = torch.einsum("bqhc,bkc->bhqk", q_latent, kv_c) + torch.einsum("bqhr,bkr->bhqk", q_pe, k_pe)
    scores = scores.float() * softmax_scale
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(num_q, num_k, dtype=torch.bool, device=q_nope.device).tril(num_k - num_q)[None]
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask[:, None, :, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv_c.dtype)
    o_latent = torch.einsum("bhqk,bkc->bqhc", probs, kv_c)  # [B, Sq, H, kv_lora_rank]
    return torch.einsum("bqhc,hvc->bqhv", o_latent, w_uv)  # [B, Sq, H, v_head_dim]


# The two forms by name, as the tests and `DeepseekV3Attention` pick them.
mla_attention_expanded = functools.partial(mla_attention, absorbed=False)
mla_attention_absorbed = functools.partial(mla_attention, absorbed=True)


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """[B, Sq, Sk] bool: query i sees key j when `k_positions[j] <= q_positions[i]` (int64)."""
    return k_positions[:, None, :] <= q_positions[:, :, None]
