"""MLA attention over a paged latent KV cache (one layer), in float or INT8, with its write path.

Position `pos` of a request lives in slot `block_table[pos // block_size] * block_size + pos % block_size`.
Queries are packed vLLM style (`query_start_loc`); query `j` of `n_b` sits at `seq_lens[b] - n_b + j`.
Two computations (DeepSeek-V2, arXiv 2405.04434, section 2.1 and the absorb remark in 2.1.2): absorbed,
`score = (q_nope W_UK) . c_kv + q_pe . k_pe`, `out = W_UV (p . c_kv)`, for few queries per request;
expanded (per-head K/V up-projected once) from `expanded_min_queries` queries. INT8 with `c_j = s_j c8_j`:
`score_ij = softmax_scale s_j (q_i . c8_j)`, `out_i = sum_j (p_ij s_j) c8_j`, exact in real arithmetic.
"""

from __future__ import annotations

import crc32c
import torch
import torch.nn.functional as F

from pdcluster.kernels.kv_quant import quantize_kv_int8
from pdcluster.kernels.mla import split_kv_b_weight
from pdcluster.kernels.mla_cost import expanded_crossover_queries

# write_prompt_kv with a checksum CRCs and copies source bytes per group of blocks of this size (fits L2).
CHECKSUM_GROUP_BYTES = 256 * 1024


def bytes_crc32c(tensor: torch.Tensor, start: int = 0) -> int:
    """CRC-32C (unsigned 32-bit) of `tensor`'s bytes in C order, any dtype or device, chained from `start`."""
    return crc32c.crc32c(tensor.detach().contiguous().cpu().view(torch.uint8).numpy(), start)


def _check_cache(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, kv_dim], got {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if kv_cache.dtype == torch.int8:
        if kv_scale is None:
            raise ValueError("an int8 kv_cache needs kv_scale [num_blocks, block_size] float32")
        if kv_scale.shape != kv_cache.shape[:2] or kv_scale.dtype != torch.float32:
            raise ValueError(
                f"kv_scale must be {tuple(kv_cache.shape[:2])} float32, "
                f"got {tuple(kv_scale.shape)} {kv_scale.dtype}"
            )
        if not kv_scale.is_contiguous():
            raise ValueError("kv_scale must be contiguous")
    elif not kv_cache.is_floating_point():
        raise ValueError(f"kv_cache must be a float or int8 tensor, got {kv_cache.dtype}")
    elif kv_scale is not None:
        raise ValueError(f"kv_scale is only for an int8 kv_cache, got a {kv_cache.dtype} cache")


def write_kv(
    kv_cache: torch.Tensor,
    latent_kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    latent_scale: torch.Tensor | None = None,
) -> None:
    """Store this step's latent KV into the paged cache, in place (quantizing for an int8 cache).

    kv_cache: `[num_blocks, block_size, kv_dim]` float, or int8 (then `kv_scale` is required).
    latent_kv: `[num_tokens, kv_dim]` float, `kv_dim = kv_lora_rank + qk_rope_head_dim`.
    slot_mapping: `[num_tokens]` int64, `block_id * block_size + offset`; `< 0` (padding) is skipped.
    kv_scale: `[num_blocks, block_size]` float32 (`absmax / 127` per token) for an int8 cache, else None.
    latent_scale: `[num_tokens]` float32 when `latent_kv` is already int8: both stored as they are.
    Raises ValueError: shape/dtype mismatch, a slot past the cache, or `kv_scale` given/missing wrongly.
    """
    _check_cache(kv_cache, kv_scale)
    num_blocks, block_size, kv_dim = kv_cache.shape
    if latent_kv.dim() != 2 or latent_kv.shape[1] != kv_dim:
        raise ValueError(f"latent_kv must be [num_tokens, {kv_dim}], got {tuple(latent_kv.shape)}")
    if latent_scale is not None and (
        kv_scale is None or latent_kv.dtype != torch.int8 or latent_scale.shape != latent_kv.shape[:1]
    ):
        raise ValueError("latent_scale: only with int8 latent_kv [num_tokens, kv_dim] into an int8 cache")
    if slot_mapping.shape != latent_kv.shape[:1] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be [{latent_kv.shape[0]}] int64, got {tuple(slot_mapping.shape)}"
        )
    slot_mapping = slot_mapping.long()
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        latent_kv, slot_mapping = latent_kv[valid], slot_mapping[valid]
        latent_scale = None if latent_scale is None else latent_scale[valid]
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_blocks * block_size:
        raise ValueError(f"slot {int(slot_mapping.max())} past the cache ({num_blocks} x {block_size} slots)")
    flat_cache = kv_cache.view(num_blocks * block_size, kv_dim)
    if kv_scale is None:
        flat_cache.index_copy_(0, slot_mapping, latent_kv.to(kv_cache.dtype))
    else:
        latent_int8, token_scale = (
            quantize_kv_int8(latent_kv) if latent_scale is None else (latent_kv, latent_scale.float())
        )
        flat_cache.index_copy_(0, slot_mapping, latent_int8)
        kv_scale.view(-1).index_copy_(0, slot_mapping, token_scale)


def write_prompt_kv(
    kv_cache: torch.Tensor,
    latent_kv: torch.Tensor,
    block_ids: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    latent_scale: torch.Tensor | None = None,
    checksum_start: int | None = None,
) -> int | None:
    """Store one request's positions `0 .. num_tokens - 1` into its blocks in place (`write_kv` by block).

    latent_kv: `[num_tokens, kv_dim]`; block_ids: `[>= ceil(num_tokens / block_size)]` int32/int64.
    Raises ValueError: as `write_kv`; also a block table too short, or a block id past the cache.
    """
    _check_cache(kv_cache, kv_scale)
    num_blocks, block_size, kv_dim = kv_cache.shape
    if latent_kv.dim() != 2 or latent_kv.shape[1] != kv_dim:
        raise ValueError(f"latent_kv must be [num_tokens, {kv_dim}], got {tuple(latent_kv.shape)}")
    num_tokens = latent_kv.shape[0]
    num_full, tail = divmod(num_tokens, block_size)
    needed = num_full + (tail > 0)
    if block_ids.dim() != 1 or block_ids.numel() < needed:
        raise ValueError(
            f"block_ids must be [>= {needed}] for {num_tokens} tokens of {block_size}-token blocks, "
            f"got {tuple(block_ids.shape)}"
        )
    block_ids = block_ids[:needed].long()
    if needed and (int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks):  # before either path
        raise ValueError(f"block ids {block_ids.tolist()} outside the cache's {num_blocks} blocks")
    fast = (
        kv_cache.device.type == "cpu"
        and latent_kv.device.type == "cpu"
        and kv_scale is None
        and latent_scale is None
        and latent_kv.dtype == kv_cache.dtype
    )
    if not fast:
        crc = None if checksum_start is None else bytes_crc32c(latent_kv, checksum_start)
        slots = slots_from_block_tables(block_ids[None].to(kv_cache.device), num_tokens, block_size)[0]
        write_kv(kv_cache, latent_kv, slots, kv_scale, latent_scale)
        return crc
    if not needed:
        return checksum_start
    cache_rows = kv_cache.view(torch.uint8).numpy().reshape(num_blocks, -1)  # one row per block
    row_bytes = kv_dim * kv_cache.element_size()
    src = latent_kv.detach().contiguous().view(torch.uint8).numpy().reshape(num_tokens, row_bytes)
    ids = block_ids.numpy()
    full_rows = src[: num_full * block_size].reshape(num_full, block_size * row_bytes)
    tail_bytes = src[num_full * block_size :].reshape(-1)
    if checksum_start is None:
        if num_full:
            cache_rows[ids[:num_full]] = full_rows
        if tail:
            cache_rows[ids[num_full], : tail * row_bytes] = tail_bytes
        return None
    crc, group = checksum_start, max(1, CHECKSUM_GROUP_BYTES // cache_rows.shape[1])
    for start in range(0, num_full, group):
        rows = full_rows[start : start + group]
        crc = crc32c.crc32c(rows, crc)  # the rows come into cache here; the copy reads them from there
        cache_rows[ids[start : start + len(rows)]] = rows  # ids also holds the tail's block
    if tail:
        crc = crc32c.crc32c(tail_bytes, crc)
        cache_rows[ids[num_full], : tail * row_bytes] = tail_bytes
    return crc


def slots_from_block_tables(block_tables: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """`[B, num_positions]` int64 slots of each request's first positions, from `block_tables [B, max_blocks]`
    int32/int64 (padding ids are clamped to >= 0: the caller masks them)."""
    positions = torch.arange(num_positions, device=block_tables.device)
    block_ids = block_tables.long()[:, positions // block_size].clamp_min(0)  # [B, num_positions]
    return block_ids * block_size + positions % block_size


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, kv_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A contiguous copy of one request's first `seq_len` cached latent rows (`block_table [max_blocks]`).

    Returns `(latent [seq_len, kv_dim] in kv_cache.dtype, scale [seq_len] float32 or None)`.
    """
    _check_cache(kv_cache, kv_scale)
    num_blocks, block_size, kv_dim = kv_cache.shape
    needed = -(-seq_len // block_size)
    if block_table.dim() != 1 or block_table.numel() < needed:
        raise ValueError(
            f"block_table must be [>= {needed}] for {seq_len} tokens of {block_size}-token blocks, "
            f"got {tuple(block_table.shape)}"
        )
    blocks = block_table[:needed].long().to(kv_cache.device)
    latent = torch.index_select(kv_cache, 0, blocks).view(-1, kv_dim)[:seq_len]
    if kv_scale is None:
        return latent, None
    return latent, torch.index_select(kv_scale, 0, blocks).view(-1)[:seq_len]


def paged_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_b_weight: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    expanded_min_queries: int | None = None,
) -> torch.Tensor:
    """Causal MLA attention of packed ragged queries over a paged latent cache (float or INT8).

    q_nope: `[num_tokens, H, qk_nope_head_dim]` float; q_pe: `[num_tokens, H, qk_rope_head_dim]`,
        rotated (`DeepseekV3Attention.project`'s first two outputs).
    kv_cache: `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` float, or int8 with `kv_scale`.
    block_tables: `[B, max_blocks]` int32/int64 block ids, padded with -1 or 0 past each request's blocks.
    seq_lens: `[B]` int64, tokens in the cache per request including this step's.
    query_start_loc: `[B + 1]` int64, cumulative query counts (`0, n_0, n_0 + n_1, ..., num_tokens`).
    kv_b_weight: `[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]` (`kv_b_proj.weight`).
    kv_scale: `[num_blocks, block_size]` float32 per-token scales of an int8 cache; None for float.
    Returns `[num_tokens, H, v_head_dim]` in `q_nope.dtype` (softmax in float32).
    Raises ValueError: inconsistent shapes/dtypes, `query_start_loc` not a ragged packing of `num_tokens`,
        `n_b > seq_lens[b]`, a request longer than its block table, or a block id out of range.
    """
    num_tokens, num_heads, qk_nope_head_dim = q_nope.shape
    qk_rope_head_dim = q_pe.shape[-1]
    _check_cache(kv_cache, kv_scale)
    num_blocks, block_size, kv_dim = kv_cache.shape
    kv_lora_rank = kv_b_weight.shape[1]
    v_head_dim = kv_b_weight.shape[0] // num_heads - qk_nope_head_dim
    if q_pe.shape[:2] != (num_tokens, num_heads) or kv_dim != kv_lora_rank + qk_rope_head_dim:
        raise ValueError(
            f"q_pe {tuple(q_pe.shape)} / kv_cache dim {kv_dim} do not match q_nope {tuple(q_nope.shape)} "
            f"and kv_lora_rank {kv_lora_rank}"
        )
    if kv_b_weight.shape[0] != num_heads * (qk_nope_head_dim + v_head_dim) or v_head_dim <= 0:
        raise ValueError(f"kv_b_weight {tuple(kv_b_weight.shape)} does not split into {num_heads} heads")
    batch, max_blocks = block_tables.shape
    if seq_lens.shape != (batch,) or query_start_loc.shape != (batch + 1,):
        raise ValueError(
            f"seq_lens must be [{batch}] and query_start_loc [{batch + 1}], "
            f"got {tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}"
        )
    seq_len_list = [int(n) for n in seq_lens.tolist()]
    starts = [int(n) for n in query_start_loc.tolist()]
    num_queries = [starts[b + 1] - starts[b] for b in range(batch)]
    if starts[0] != 0 or starts[-1] != num_tokens or min(num_queries, default=0) < 0:
        raise ValueError(f"query_start_loc {starts} is not a ragged packing of {num_tokens} tokens")
    for b in range(batch):
        if num_queries[b] > seq_len_list[b] or seq_len_list[b] > max_blocks * block_size:
            raise ValueError(
                f"request {b}: {num_queries[b]} queries, seq_len {seq_len_list[b]}, "
                f"block table capacity {max_blocks * block_size}"
            )
    used_blocks = (
        torch.arange(max_blocks, device=block_tables.device)[None]
        < ((seq_lens.to(block_tables.device) + block_size - 1) // block_size)[:, None]
    )
    if bool((used_blocks & ((block_tables < 0) | (block_tables >= num_blocks))).any()):
        raise ValueError(f"block_tables hold an id outside [0, {num_blocks}) within a request's length")

    w_uk, w_uv = split_kv_b_weight(kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
    if expanded_min_queries is None:
        expanded_min_queries = expanded_crossover_queries(
            kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        )
    out = q_nope.new_zeros(num_tokens, num_heads, v_head_dim)
    few = [b for b in range(batch) if 0 < num_queries[b] < expanded_min_queries]
    if few:
        token_index, few_out = _absorbed_batch(
            q_nope,
            q_pe,
            kv_cache,
            kv_scale,
            block_tables[few],
            seq_lens[few],
            query_start_loc[:-1][few],
            torch.tensor([num_queries[b] for b in few], device=seq_lens.device),
            w_uk,
            w_uv,
            softmax_scale,
        )
        out[token_index] = few_out
    for b in range(batch):
        if num_queries[b] >= max(expanded_min_queries, 1):
            latent, token_scale = gather_kv(kv_cache, block_tables[b], seq_len_list[b], kv_scale)
            rows = slice(starts[b], starts[b + 1])
            out[rows] = _expanded_one(
                q_nope[rows], q_pe[rows], latent, token_scale, kv_b_weight, softmax_scale
            )
    return out


def _absorbed_batch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    num_queries: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention for `b` requests padded to `[b, max_queries, max_seq_len]`."""
    device = q_nope.device
    kv_lora_rank = w_uk.shape[-1]
    kv_dim = kv_cache.shape[-1]
    seq_lens, query_starts, num_queries = seq_lens.to(device), query_starts.to(device), num_queries.to(device)
    max_queries, max_seq_len = int(num_queries.max()), int(seq_lens.max())
    query_offsets = torch.arange(max_queries, device=device)
    query_valid = query_offsets[None] < num_queries[:, None]  # [b, max_q]
    token_index = torch.where(query_valid, query_starts[:, None] + query_offsets, 0)  # [b, max_q]
    key_positions = torch.arange(max_seq_len, device=device)
    key_valid = key_positions[None] < seq_lens[:, None]  # [b, max_seq_len]
    slots = slots_from_block_tables(block_tables.to(device), max_seq_len, kv_cache.shape[1])
    # Keys past a request's length may be garbage (even NaN): zero them so 0-probability x NaN cannot leak.
    latent = kv_cache.view(-1, kv_dim)[slots].to(q_nope.dtype)  # [b, max_seq_len, kv_dim], int8 -> values
    latent = torch.where(key_valid[..., None], latent, 0)
    kv_c, k_pe = latent.split([kv_lora_rank, kv_dim - kv_lora_rank], dim=-1)

    q_latent = torch.einsum("bqhd,hdc->bqhc", q_nope[token_index], w_uk)  # [b, max_q, H, kv_lora_rank]
    scores = torch.einsum("bqhc,bkc->bhqk", q_latent, kv_c)
    scores = (scores + torch.einsum("bqhr,bkr->bhqk", q_pe[token_index], k_pe)).float()
    token_scale = None
    if kv_scale is not None:
        token_scale = torch.where(key_valid, kv_scale.view(-1)[slots], 0.0)  # [b, max_seq_len] float32
        scores = scores * token_scale[:, None, None, :]  # score_ij = s_j (q_i . c8_j)
    scores = scores * softmax_scale
    query_positions = seq_lens[:, None] - num_queries[:, None] + query_offsets  # [b, max_q]
    # Causal; padded query rows (position >= seq_len) see all valid keys, so no row is fully masked.
    may_attend = (key_positions[None, None] <= query_positions[..., None]) & key_valid[:, None]
    scores = scores.masked_fill(~may_attend[:, None], float("-inf"))
    probs = scores.softmax(dim=-1)  # [b, H, max_q, max_seq_len] float32
    if token_scale is not None:
        probs = probs * token_scale[:, None, None, :]  # out_i = sum_j (p_ij s_j) c8_j
    o_latent = torch.einsum("bhqk,bkc->bqhc", probs.to(q_nope.dtype), kv_c)  # [b, max_q, H, kv_lora_rank]
    out = torch.einsum("bqhc,hvc->bqhv", o_latent, w_uv)  # [b, max_q, H, v_head_dim]
    return token_index[query_valid], out[query_valid]


def _expanded_one(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    token_scale: torch.Tensor | None,
    kv_b_weight: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Expanded attention of one request: `q [n, H, *]` over its gathered `latent [seq_len, kv_dim]`."""
    num_queries, num_heads, qk_nope_head_dim = q_nope.shape
    seq_len, kv_dim = latent.shape
    kv_lora_rank = kv_b_weight.shape[1]
    latent = latent.to(q_nope.dtype)
    kv_c, k_pe = latent.split([kv_lora_rank, kv_dim - kv_lora_rank], dim=-1)
    kv = F.linear(kv_c, kv_b_weight).view(seq_len, num_heads, -1)  # [seq_len, H, dn + dv]
    if token_scale is not None:
        scale = token_scale.to(q_nope.dtype)
        kv, k_pe = kv * scale[:, None, None], k_pe * scale[:, None]
    k_nope, v = kv.split([qk_nope_head_dim, kv.shape[-1] - qk_nope_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)  # [seq_len, H, dn + dr]
    q = torch.cat((q_nope, q_pe), dim=-1)  # [n, H, dn + dr]
    query_positions = seq_len - num_queries + torch.arange(num_queries, device=q.device)
    may_attend = torch.arange(seq_len, device=q.device)[None] <= query_positions[:, None]  # [n, seq_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=may_attend, scale=softmax_scale
    )  # [H, n, v_head_dim]
    return out.transpose(0, 1)
