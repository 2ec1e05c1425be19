"""MLA attention: expanded and weight-absorbed forms against a per-(batch, head, query) loop."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.mla import (
    causal_mask,
    mla_attention_absorbed,
    mla_attention_expanded,
    split_kv_b_weight,
)

NUM_HEADS, QK_NOPE, QK_ROPE, V_DIM, KV_LORA = 3, 8, 4, 6, 10
SCALE = 0.37


def inputs(batch: int, num_q: int, num_k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q_nope=torch.randn(batch, num_q, NUM_HEADS, QK_NOPE, generator=gen),
        q_pe=torch.randn(batch, num_q, NUM_HEADS, QK_ROPE, generator=gen),
        kv_c=torch.randn(batch, num_k, KV_LORA, generator=gen),
        k_pe=torch.randn(batch, num_k, QK_ROPE, generator=gen),
        kv_b_weight=torch.randn(NUM_HEADS * (QK_NOPE + V_DIM), KV_LORA, generator=gen) / KV_LORA**0.5,
    )


def reference_mla(q_nope, q_pe, kv_c, k_pe, kv_b_weight, softmax_scale, mask) -> torch.Tensor:
    """Loop over batch, head and query: keys/values up-projected per head, masked softmax, weighted sum.

    mask: bool `[B, Sq, Sk]`, True where the query may attend. Returns `[B, Sq, H, v_head_dim]`.
    """
    batch, num_q, num_heads, qk_nope = q_nope.shape
    w = kv_b_weight.view(num_heads, -1, kv_c.shape[-1])  # [H, qk_nope + v, kv_lora]
    out = torch.zeros(batch, num_q, num_heads, w.shape[1] - qk_nope, dtype=torch.float64)
    for b in range(batch):
        for h in range(num_heads):
            keys = torch.cat((kv_c[b].double() @ w[h, :qk_nope].double().T, k_pe[b].double()), -1)
            values = kv_c[b].double() @ w[h, qk_nope:].double().T
            for i in range(num_q):
                query = torch.cat((q_nope[b, i, h], q_pe[b, i, h])).double()
                scores = (keys @ query) * softmax_scale
                scores[~mask[b, i]] = float("-inf")
                out[b, i, h] = scores.softmax(-1) @ values
    return out.float()


def test_split_kv_b_weight() -> None:
    w = torch.arange(NUM_HEADS * (QK_NOPE + V_DIM) * KV_LORA, dtype=torch.float32).view(-1, KV_LORA)
    w_uk, w_uv = split_kv_b_weight(w, NUM_HEADS, QK_NOPE, V_DIM)
    assert w_uk.shape == (NUM_HEADS, QK_NOPE, KV_LORA) and w_uv.shape == (NUM_HEADS, V_DIM, KV_LORA)
    for h in range(NUM_HEADS):
        rows = w[h * (QK_NOPE + V_DIM) : (h + 1) * (QK_NOPE + V_DIM)]
        assert torch.equal(w_uk[h], rows[:QK_NOPE]) and torch.equal(w_uv[h], rows[QK_NOPE:])


def test_causal_mask_positions() -> None:
    q_positions = torch.tensor([[3, 4], [0, 1]])
    k_positions = torch.arange(5).expand(2, 5)
    mask = causal_mask(q_positions, k_positions)
    assert mask.shape == (2, 2, 5)
    assert mask[0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert mask[1].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]


@pytest.mark.parametrize(
    "attention", [mla_attention_expanded, mla_attention_absorbed], ids=["expanded", "absorbed"]
)
def test_causal_prefill_matches_reference(attention) -> None:
    x = inputs(batch=2, num_q=7, num_k=7)
    mask = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 7, 7)
    want = reference_mla(**x, softmax_scale=SCALE, mask=mask)
    got = attention(**x, softmax_scale=SCALE, is_causal=True)
    assert got.shape == (2, 7, NUM_HEADS, V_DIM)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # an explicit mask gives the same result as is_causal
    torch.testing.assert_close(attention(**x, softmax_scale=SCALE, attn_mask=mask), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "attention", [mla_attention_expanded, mla_attention_absorbed], ids=["expanded", "absorbed"]
)
@pytest.mark.parametrize("num_q", [1, 3])
def test_decode_and_chunk_with_explicit_mask_match_reference(attention, num_q) -> None:
    """Queries at the end of a longer context (decode, or a later prefill chunk), with a different
    context length per sequence expressed through the positions."""
    num_k = 9
    x = inputs(batch=2, num_q=num_q, num_k=num_k, seed=num_q)
    context_lens = torch.tensor([9, 6])  # sequence 1 only has 6 valid keys
    q_positions = context_lens[:, None] - num_q + torch.arange(num_q)[None]
    k_positions = torch.arange(num_k).expand(2, num_k).clone()
    k_positions[1, 6:] = 10**6  # padding keys: never visible
    mask = causal_mask(q_positions, k_positions)
    want = reference_mla(**x, softmax_scale=SCALE, mask=mask)
    torch.testing.assert_close(
        attention(**x, softmax_scale=SCALE, attn_mask=mask), want, rtol=1e-5, atol=1e-5
    )


def test_absorbed_equals_expanded_in_bfloat16() -> None:
    x = {k: v.to(torch.bfloat16) for k, v in inputs(batch=1, num_q=5, num_k=5, seed=7).items()}
    expanded = mla_attention_expanded(**x, softmax_scale=SCALE, is_causal=True)
    absorbed = mla_attention_absorbed(**x, softmax_scale=SCALE, is_causal=True)
    assert expanded.dtype == absorbed.dtype == torch.bfloat16
    torch.testing.assert_close(absorbed.float(), expanded.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("fn", [mla_attention_expanded, mla_attention_absorbed])
def test_is_causal_needs_as_many_queries_as_keys(fn) -> None:
    """A square causal mask is ambiguous for Sq != Sk (top-left or bottom-right?): both forms refuse it."""
    x = inputs(batch=1, num_q=2, num_k=5, seed=3)
    with pytest.raises(ValueError, match="is_causal"):
        fn(**x, softmax_scale=SCALE, is_causal=True)
