"""Absorbed MLA attention for a uniform decode batch, with fixed shapes for graph capture.

Keys are each request's cached positions followed by this step's `q` latents (passed in, written to the
cache by the caller afterwards); query j sees the cache and this step's keys 0..j. Source: DeepSeek-V2
(arXiv 2405.04434) section 2.1.2: `score = (q_nope W_UK) . c_kv + q_pe . k_pe`, `out = W_UV (p . c_kv)`.
"""

from __future__ import annotations

import torch


def mla_decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    new_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
    num_queries: int,
) -> torch.Tensor:
    """Causal absorbed MLA attention of `B` requests with `num_queries` (q) queries each.

    q_nope: [B * q, H, qk_nope_head_dim]; q_pe: [B * q, H, qk_rope_head_dim], rotated, request-major
    new_latent: [B * q, kv_lora_rank + qk_rope_head_dim] cache dtype
    kv_cache: [num_blocks, block_size, kv_dim] float (not int8)
    block_tables: [B, C] int64; context_lens: [B] int64, cached tokens before this step
    w_uk: [H, qk_nope_head_dim, kv_lora_rank]; w_uv: [H, v_head_dim, kv_lora_rank]
    returns [B * q, H, v_head_dim] in `q_nope.dtype` (softmax in float32)
    """
    batch, num_columns = block_tables.shape
    num_blocks, block_size, kv_dim = kv_cache.shape
    kv_lora_rank = w_uk.shape[-1]
    num_heads = q_nope.shape[1]
    key_positions = torch.arange(num_columns * block_size, device=kv_cache.device)
    slots = block_tables[:, key_positions // block_size] * block_size + key_positions % block_size
    cached = kv_cache.view(num_blocks * block_size, kv_dim)[slots]  # [B, K, kv_dim]
    key_valid = key_positions[None] < context_lens[:, None]  # [B, K]
    # Slots past a request's context may hold anything (even NaN): zero them before any product.
    cached = torch.where(key_valid[..., None], cached, 0).to(q_nope.dtype)
    latent = torch.cat((cached, new_latent.to(q_nope.dtype).view(batch, num_queries, kv_dim)), dim=1)
    kv_c, k_pe = latent.split([kv_lora_rank, kv_dim - kv_lora_rank], dim=-1)

    q_nope = q_nope.view(batch, num_queries, num_heads, -1)
    q_pe = q_pe.view(batch, num_queries, num_heads, -1)
    q_latent = torch.einsum("bqhd,hdc->bqhc", q_nope, w_uk)  # [B, q, H, kv_lora_rank]
    scores = torch.einsum("bqhc,bkc->bhqk", q_latent, kv_c)
    scores = (scores + torch.einsum("bqhr,bkr->bhqk", q_pe, k_pe)).float() * softmax_scale
    offsets = torch.arange(num_queries, device=kv_cache.device)
    causal = offsets[None, :] <= offsets[:, None]  # [q (query), q (key)]
    may_attend = torch.cat(
        (
            key_valid[:, None, :].expand(batch, num_queries, -1),
            causal[None].expand(batch, num_queries, num_queries),
        ),
        dim=-1,
    )  # [B, q, K + q]
    scores = scores.masked_fill(~may_attend[:, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(q_nope.dtype)  # [B, H, q, K + q]
    o_latent = torch.einsum("bhqk,bkc->bqhc", probs, kv_c)
    out = torch.einsum("bqhc,hvc->bqhv", o_latent, w_uv)  # [B, q, H, v_head_dim]
    return out.reshape(batch * num_queries, num_heads, -1)
