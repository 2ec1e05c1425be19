"""`kernels.mla_decode` (the fixed-shape decode attention of the compiled forward) against
`kernels.paged_mla.paged_mla_attention` on the same cache: uniform decode (q = 1) and verification
(q = 4) batches whose cache holds NaN past each request's context, so an unmasked read would show."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.mla import split_kv_b_weight
from pdcluster.kernels.mla_decode import mla_decode_attention
from pdcluster.kernels.paged_mla import paged_mla_attention, slots_from_block_tables, write_kv

NUM_HEADS, QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, V_HEAD_DIM, KV_LORA_RANK = 4, 8, 4, 6, 16
KV_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
SOFTMAX_SCALE = (QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM) ** -0.5
BLOCK_SIZE, NUM_BLOCKS = 4, 40


@pytest.mark.parametrize("num_queries", [1, 4])
def test_decode_attention_equals_paged_attention(num_queries: int) -> None:
    gen = torch.Generator().manual_seed(num_queries)
    seq_lens = [num_queries + c for c in (0, 5, 12, 3)]  # context 0 (first step after nothing) .. 12
    batch = len(seq_lens)
    num_columns = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1  # a spare column past every request
    block_ids = torch.randperm(NUM_BLOCKS, generator=gen)[: batch * num_columns]
    block_tables = block_ids.view(batch, num_columns)
    kv_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_DIM), float("nan"))
    context = [n - num_queries for n in seq_lens]
    for b, n in enumerate(context):  # the cached context; this step's latents are passed separately
        slots = slots_from_block_tables(block_tables[b : b + 1], n, BLOCK_SIZE)[0]
        write_kv(kv_cache, torch.randn(n, KV_DIM, generator=gen), slots)
    num_tokens = batch * num_queries
    q_nope = torch.randn(num_tokens, NUM_HEADS, QK_NOPE_HEAD_DIM, generator=gen)
    q_pe = torch.randn(num_tokens, NUM_HEADS, QK_ROPE_HEAD_DIM, generator=gen)
    new_latent = torch.randn(num_tokens, KV_DIM, generator=gen)
    kv_b = torch.randn(NUM_HEADS * (QK_NOPE_HEAD_DIM + V_HEAD_DIM), KV_LORA_RANK, generator=gen) * 0.25
    w_uk, w_uv = split_kv_b_weight(kv_b, NUM_HEADS, QK_NOPE_HEAD_DIM, V_HEAD_DIM)

    out = mla_decode_attention(
        q_nope, q_pe, new_latent, kv_cache, block_tables, torch.tensor(context), w_uk, w_uv,
        SOFTMAX_SCALE, num_queries,
    )  # fmt: skip
    assert torch.isfinite(out).all()  # the cache was not written: NaN there was never read

    paged_cache = kv_cache.clone()
    new_slots = torch.cat(
        [
            slots_from_block_tables(block_tables[b : b + 1], n, BLOCK_SIZE)[0][n - num_queries :]
            for b, n in enumerate(seq_lens)
        ]
    )
    write_kv(paged_cache, new_latent, new_slots)
    expected = paged_mla_attention(
        q_nope, q_pe, paged_cache, block_tables, torch.tensor(seq_lens),
        torch.arange(0, num_tokens + 1, num_queries), kv_b, SOFTMAX_SCALE,
    )  # fmt: skip
    # Same function, other summation order (keys split into cache + new): float32 rounding only.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
