"""Paged MLA attention (float and INT8) against the non-paged references in `kernels.mla`.

The reference for request b is `mla_attention_absorbed` over that request's contiguous latent (the very
rows written to the cache), with the causal mask of its queries at positions `seq_len - n + j`.
"""

from __future__ import annotations

import sys

import pytest
import torch

from pdcluster.kernels.kv_quant import dequantize_kv_int8, quantize_kv_int8
from pdcluster.kernels.mla import causal_mask, mla_attention_absorbed
from pdcluster.kernels.paged_mla import (
    expanded_crossover_queries,
    gather_kv,
    paged_mla_attention,
    slots_from_block_tables,
    write_kv,
    write_prompt_kv,
)

NUM_HEADS, QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, V_HEAD_DIM, KV_LORA_RANK = 4, 8, 4, 6, 16
KV_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
SOFTMAX_SCALE = (QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM) ** -0.5
# Ragged batch: decode, spec-verify (k=3), decode at length 1, full prefill, prefill chunk.
SEQ_LENS = [7, 13, 1, 20, 9]
NUM_QUERIES = [1, 4, 1, 20, 5]


def make_batch(
    seed: int,
    *,
    block_size: int = 4,
    num_blocks: int = 40,
    pad_value: int = -1,
    table_dtype: torch.dtype = torch.int64,
    int8: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """A ragged batch written into a paged cache through randomly permuted block ids.

    The cache starts as NaN (float) so unmasked reads of unwritten slots would show up in the output.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(SEQ_LENS)
    max_blocks = max(-(-n // block_size) for n in SEQ_LENS) + 1  # one spare padding column
    block_ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((batch, max_blocks), pad_value, dtype=table_dtype)
    next_block = 0
    for b, seq_len in enumerate(SEQ_LENS):
        num_used = -(-seq_len // block_size)
        block_tables[b, :num_used] = block_ids[next_block : next_block + num_used].to(table_dtype)
        next_block += num_used
    latents = [torch.randn(n, KV_DIM, generator=gen) for n in SEQ_LENS]
    if int8:
        kv_cache = torch.zeros(num_blocks, block_size, KV_DIM, dtype=torch.int8)
        kv_scale = torch.full((num_blocks, block_size), float("nan"))
    else:
        kv_cache = torch.full((num_blocks, block_size, KV_DIM), float("nan"), dtype=dtype)
        kv_scale = None
    slot_mapping = torch.cat(
        [slots_from_block_tables(block_tables[b : b + 1], n, block_size)[0] for b, n in enumerate(SEQ_LENS)]
    )
    write_kv(kv_cache, torch.cat(latents).to(dtype), slot_mapping, kv_scale)
    num_tokens = sum(NUM_QUERIES)
    return dict(
        q_nope=torch.randn(num_tokens, NUM_HEADS, QK_NOPE_HEAD_DIM, generator=gen).to(dtype),
        q_pe=torch.randn(num_tokens, NUM_HEADS, QK_ROPE_HEAD_DIM, generator=gen).to(dtype),
        kv_cache=kv_cache,
        kv_scale=kv_scale,
        block_tables=block_tables,
        seq_lens=torch.tensor(SEQ_LENS),
        query_start_loc=torch.tensor([0, *torch.tensor(NUM_QUERIES).cumsum(0).tolist()]),
        kv_b_weight=(
            torch.randn(NUM_HEADS * (QK_NOPE_HEAD_DIM + V_HEAD_DIM), KV_LORA_RANK, generator=gen)
            * KV_LORA_RANK**-0.5
        ).to(dtype),
        latents=latents,
    )


def run_paged(batch: dict, **kwargs) -> torch.Tensor:
    return paged_mla_attention(
        batch["q_nope"],
        batch["q_pe"],
        batch["kv_cache"],
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
        batch["kv_b_weight"],
        SOFTMAX_SCALE,
        batch["kv_scale"],
        **kwargs,
    )


def reference(batch: dict, latents: list[torch.Tensor]) -> torch.Tensor:
    """Per request: `mla_attention_absorbed` over its contiguous latent, causal at `seq_len - n + j`."""
    outs, start = [], 0
    for latent, seq_len, num_queries in zip(latents, SEQ_LENS, NUM_QUERIES, strict=True):
        rows = slice(start, start + num_queries)
        start += num_queries
        q_positions = torch.arange(seq_len - num_queries, seq_len)[None]
        mask = causal_mask(q_positions, torch.arange(seq_len)[None])
        kv_c, k_pe = latent.float()[None].split([KV_LORA_RANK, QK_ROPE_HEAD_DIM], dim=-1)
        outs.append(
            mla_attention_absorbed(
                batch["q_nope"][rows][None].float(),
                batch["q_pe"][rows][None].float(),
                kv_c,
                k_pe,
                batch["kv_b_weight"].float(),
                SOFTMAX_SCALE,
                attn_mask=mask,
            )[0]
        )
    return torch.cat(outs)


PATHS = {"default": None, "all_expanded": 1, "all_absorbed": sys.maxsize}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pad_value,table_dtype", [(-1, torch.int32), (0, torch.int64)])
def test_paged_float_matches_absorbed_reference(path: str, pad_value: int, table_dtype: torch.dtype) -> None:
    batch = make_batch(0, pad_value=pad_value, table_dtype=table_dtype)
    out = run_paged(batch, expanded_min_queries=PATHS[path])
    assert out.shape == (sum(NUM_QUERIES), NUM_HEADS, V_HEAD_DIM) and out.dtype == torch.float32
    assert (out - reference(batch, batch["latents"])).abs().max() <= 1e-5


def test_default_threshold_mixes_paths() -> None:
    """With these dims the crossover is 13 queries: the 20-query prefill is expanded, the rest absorbed."""
    assert expanded_crossover_queries(KV_LORA_RANK, QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, V_HEAD_DIM) == 13
    assert expanded_crossover_queries(512, 128, 64, 128) == 171  # DeepSeek-V3
    assert expanded_crossover_queries(64, 64, 32, 64) == sys.maxsize  # expanded never cheaper


@pytest.mark.parametrize("path", PATHS)
def test_paged_int8_equals_float_on_dequantized_cache(path: str) -> None:
    """Scales folded into scores/probabilities == float attention over the dequantized latent (1e-5);
    and within 2% relative (Frobenius) error of the unquantized float result (int8 step = absmax/127)."""
    batch = make_batch(1, int8=True)
    out_int8 = run_paged(batch, expanded_min_queries=PATHS[path])
    dequantized = [dequantize_kv_int8(*quantize_kv_int8(latent)) for latent in batch["latents"]]
    assert (out_int8 - reference(batch, dequantized)).abs().max() <= 1e-5
    exact = reference(batch, batch["latents"])
    assert (out_int8 - exact).norm() / exact.norm() < 0.02


def test_bf16_cache_close_to_float32() -> None:
    batch = make_batch(2, dtype=torch.bfloat16)
    out = run_paged(batch)
    assert out.dtype == torch.bfloat16
    assert (out.float() - reference(batch, [x.bfloat16() for x in batch["latents"]])).abs().max() < 3e-2


def test_write_kv_skips_padding_slots_and_gathers_back() -> None:
    kv_cache = torch.zeros(3, 2, KV_DIM)
    latent = torch.randn(3, KV_DIM)
    write_kv(kv_cache, latent, torch.tensor([5, -1, 0]))
    assert torch.equal(kv_cache.view(-1, KV_DIM)[5], latent[0]) and torch.equal(kv_cache[0, 0], latent[2])
    assert kv_cache.view(-1, KV_DIM)[1:5].abs().sum() == 0
    gathered, scale = gather_kv(kv_cache, torch.tensor([2, 0, -1]), 3)
    assert scale is None and torch.equal(gathered, kv_cache.view(-1, KV_DIM)[[4, 5, 0]])


def test_write_kv_int8_stores_values_and_scales() -> None:
    kv_cache = torch.zeros(2, 4, KV_DIM, dtype=torch.int8)
    kv_scale = torch.zeros(2, 4)
    latent = torch.randn(3, KV_DIM)
    write_kv(kv_cache, latent, torch.tensor([6, 1, 2]), kv_scale)
    stored, scale = gather_kv(kv_cache, torch.tensor([1, 0]), 3, kv_scale)  # positions 0,1,2 -> slots 4,5,6
    expected_int8, expected_scale = quantize_kv_int8(latent[0:1])
    assert torch.equal(stored[2], expected_int8[0]) and torch.equal(scale[2], expected_scale[0])
    assert torch.allclose(
        dequantize_kv_int8(kv_cache.view(-1, KV_DIM)[[1, 2]], kv_scale.view(-1)[[1, 2]]),
        latent[1:],
        atol=latent[1:].abs().max().item() / 127,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("num_tokens", [0, 3, 8, 11])  # block_size 4: none, a partial block, 2 full, 2 + 3
def test_write_prompt_kv_stores_what_write_kv_stores(dtype: torch.dtype, num_tokens: int) -> None:
    """Block by block (numpy on the host for a float cache; `write_kv` otherwise), the same bytes land in the
    same slots as `write_kv` with the request's slots, and nothing else changes: a byte copy, so equal. (The
    int8 cache takes `write_kv` itself, so there the check that counts is the read-back: `gather_kv`, by
    whole blocks, returns the values written.)"""
    gen = torch.Generator().manual_seed(num_tokens)
    block_ids = torch.tensor([5, 0, 3, 6])  # out of order, with a spare entry past what the tokens need
    int8 = dtype == torch.int8
    latent = torch.randn(num_tokens, KV_DIM, generator=gen)
    latent_scale = None
    if int8:
        latent, latent_scale = quantize_kv_int8(latent)
    else:
        latent = latent.to(dtype)
    caches = []
    for write in ("write_kv", "write_prompt_kv"):
        kv_cache = torch.randn(8, 4, KV_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
        kv_scale = torch.full((8, 4), 7.0) if int8 else None
        if write == "write_kv":
            slots = slots_from_block_tables(block_ids[None], num_tokens, 4)[0]
            write_kv(kv_cache, latent, slots, kv_scale, latent_scale)
        else:
            write_prompt_kv(kv_cache, latent, block_ids, kv_scale, latent_scale)
        caches.append((kv_cache, kv_scale))
    (want, want_scale), (got, got_scale) = caches
    assert torch.equal(got, want) and (not int8 or torch.equal(got_scale, want_scale))
    stored, _ = gather_kv(got, block_ids, num_tokens, got_scale)
    assert torch.equal(stored, latent)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8, torch.float32])  # fast path, write_kv x2
@pytest.mark.parametrize("num_tokens", [0, 3, 8, 11, 29])  # none, partial, full, full + partial, 3 groups +
def test_write_prompt_kv_with_a_checksum_returns_the_crc_of_the_bytes_and_stores_the_same(
    cache_dtype: torch.dtype, num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `checksum_start` the CRC-32C of the bf16 source's bytes continuing from it (what a sender's
    header carries), and the cache ends as it does without a checksum, byte for byte. The float32 cache
    takes a bf16 source through `write_kv` (a cast): the CRC is still that of the bytes given. Groups of 3
    blocks here, so 29 tokens (7 full blocks + 1) cross several groups."""
    import crc32c

    from pdcluster.kernels import paged_mla

    block_size = 4
    monkeypatch.setattr(paged_mla, "CHECKSUM_GROUP_BYTES", 3 * block_size * KV_DIM * 2)
    latent = torch.randn(num_tokens, KV_DIM, generator=torch.Generator().manual_seed(num_tokens)).bfloat16()
    block_ids = torch.randperm(10, generator=torch.Generator().manual_seed(2))
    caches, returned = [], []
    for checksum_start in (None, 12345):
        kv_cache = torch.randn(10, block_size, KV_DIM, generator=torch.Generator().manual_seed(1)).to(
            cache_dtype
        )
        kv_scale = torch.full((10, block_size), 7.0) if cache_dtype == torch.int8 else None
        returned.append(write_prompt_kv(kv_cache, latent, block_ids, kv_scale, None, checksum_start))
        caches.append((kv_cache, kv_scale))
    assert returned == [None, crc32c.crc32c(latent.view(torch.uint8).numpy(), 12345)]
    (want, want_scale), (got, got_scale) = caches
    assert torch.equal(got, want) and (want_scale is None or torch.equal(got_scale, want_scale))


def test_write_prompt_kv_invalid_arguments_raise() -> None:
    kv_cache = torch.zeros(4, 4, KV_DIM)
    with pytest.raises(ValueError, match="block_ids must be"):
        write_prompt_kv(kv_cache, torch.zeros(9, KV_DIM), torch.tensor([0, 1]))  # 9 tokens need 3 blocks
    with pytest.raises(ValueError, match="outside the cache"):
        write_prompt_kv(kv_cache, torch.zeros(5, KV_DIM), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="latent_kv must be"):
        write_prompt_kv(kv_cache, torch.zeros(5, KV_DIM + 1), torch.tensor([0, 1]))
    for latent in (torch.ones(5, KV_DIM), torch.ones(5, KV_DIM, dtype=torch.float64)):  # fast, write_kv path
        with pytest.raises(ValueError, match="outside the cache"):  # a padded table's -1 is no block 0
            write_prompt_kv(kv_cache, latent, torch.tensor([1, -1]))
    assert kv_cache.abs().sum() == 0


def test_invalid_arguments_raise() -> None:
    batch = make_batch(3)
    with pytest.raises(ValueError, match="kv_scale is only for an int8"):
        write_kv(batch["kv_cache"], torch.zeros(1, KV_DIM), torch.tensor([0]), torch.zeros(40, 4))
    with pytest.raises(ValueError, match="needs kv_scale"):
        write_kv(torch.zeros(2, 4, KV_DIM, dtype=torch.int8), torch.zeros(1, KV_DIM), torch.tensor([0]))
    with pytest.raises(ValueError, match="past the cache"):
        write_kv(batch["kv_cache"], torch.zeros(1, KV_DIM), torch.tensor([40 * 4]))
    bad = dict(batch, seq_lens=torch.tensor([7, 13, 1, 19, 9]))  # 20 queries > 19 tokens
    with pytest.raises(ValueError, match="request 3"):
        run_paged(bad)
    bad = dict(batch, query_start_loc=batch["query_start_loc"] + 1)
    with pytest.raises(ValueError, match="ragged packing"):
        run_paged(bad)
    tables = batch["block_tables"].clone()
    tables[0, 0] = 40
    with pytest.raises(ValueError, match="outside"):
        run_paged(dict(batch, block_tables=tables))


@pytest.mark.parametrize("int8", [False, True])
def test_chunked_prefill_then_decode_matches_cacheless_layer(int8: bool) -> None:
    """Integration with `DeepseekV3Attention` (tiny YaRN model): prefill in chunks of 5 and 4 tokens, a
    3-token verify step, then 2 decode steps through `write_kv` + `paged_mla_attention` reproduce the
    layer's cache-less causal attention over all 14 tokens (1e-5 float; 2% relative for int8, ~0.6% seen)."""
    from tests.conftest import tiny_model

    model = tiny_model(yarn=True)
    config, attn = model.config, model.model.layers[0].self_attn
    seq_len, block_size = 14, 4
    hidden = torch.randn(seq_len, config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rope(torch.arange(seq_len))
    with torch.no_grad():
        q_nope, q_pe, latent_kv = attn.project(hidden, cos, sin)
        expected = attn.attend(q_nope[None], q_pe[None], latent_kv[None], is_causal=True)[0]
        block_table = torch.tensor([[5, 2, 7, 0, -1]])
        kv_cache = torch.zeros(
            8, block_size, config.kv_cache_dim, dtype=torch.int8 if int8 else torch.float32
        )
        kv_scale = torch.zeros(8, block_size) if int8 else None
        slots = slots_from_block_tables(block_table, seq_len, block_size)[0]
        outs, start = [], 0
        for num_new in (5, 4, 3, 1, 1):
            rows = slice(start, start + num_new)
            start += num_new
            write_kv(kv_cache, latent_kv[rows], slots[rows], kv_scale)
            out = paged_mla_attention(
                q_nope[rows],
                q_pe[rows],
                kv_cache,
                block_table,
                torch.tensor([start]),
                torch.tensor([0, num_new]),
                attn.kv_b_proj.weight,
                config.softmax_scale,
                kv_scale,
            )
            outs.append(attn.o_proj(out.reshape(num_new, -1)))
    paged = torch.cat(outs)
    if int8:
        assert (paged - expected).norm() / expected.norm() < 0.02
    else:
        assert (paged - expected).abs().max() <= 1e-5
