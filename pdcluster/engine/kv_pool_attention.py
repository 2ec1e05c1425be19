"""The model runner's side of KV block pools (`engine.kv_pools`): per-pool, per-layer cache tensors, and one
layer's KV write + paged MLA attention over a batch whose requests sit in different pools.

Each pool `p` holds, per layer, `[num_blocks[p], block_size, kv_dim]` in that layer's dtype (int8 with
`[num_blocks[p], block_size]` float32 scales). A request's pool is the pool of its first block id (ids are
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from pdcluster.engine.kv_precision import LayerDtypes
from pdcluster.kernels.paged_mla import paged_mla_attention, write_kv


class _PoolSlice(NamedTuple):
    """The part of a packed batch in one pool. rows: `[n]` int64 token rows; the rest as `ModelInput` with
    local block ids.
    """

    pool: int
    rows: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


class KVPoolCaches:
    """Per-pool cache tensors of every layer (see the module docstring)."""

    def __init__(
        self,
        pools: list[LayerDtypes],
        num_blocks_per_pool: list[int],
        block_size: int,
        kv_dim: int,
        device: torch.device,
    ) -> None:
        if len(pools) != len(num_blocks_per_pool) or not pools:
            raise ValueError(f"{len(pools)} pools with {len(num_blocks_per_pool)} block counts")
        self.pools = pools
        self.block_size = block_size
        self.offsets = [0, *itertools.accumulate(num_blocks_per_pool)][:-1]
        self.num_blocks_per_pool = list(num_blocks_per_pool)
        self.caches: list[list[torch.Tensor]] = []  # [pool][layer]
        self.scales: list[list[torch.Tensor | None]] = []
        for dtypes, n in zip(pools, num_blocks_per_pool, strict=True):
            self.caches.append([torch.zeros(n, block_size, kv_dim, dtype=d, device=device) for d in dtypes])
            self.scales.append(
                [
                    torch.zeros(n, block_size, dtype=torch.float32, device=device)
                    if d == torch.int8
                    else None
                    for d in dtypes
                ]
            )
        self._slices: list[_PoolSlice] = []

    def pool_of_block(self, block_id: int) -> int:
        for p in range(len(self.offsets) - 1, -1, -1):
            if block_id >= self.offsets[p]:
                return p
        raise ValueError(f"block id {block_id} < 0")

    def layer_cache(
        self, layer_idx: int, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`(cache, scale or None, local block ids)` of one request's blocks (global ids, one pool)."""
        p = self.pool_of_block(int(block_ids[0]))
        return self.caches[p][layer_idx], self.scales[p][layer_idx], block_ids - self.offsets[p]

    def begin_step(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> None:
        """Split a packed batch (`model_runner.ModelInput`'s tensors) by pool for this forward's layers."""
        first_blocks = block_tables[:, 0].tolist()
        starts = query_start_loc.tolist()
        by_pool: dict[int, list[int]] = {}
        for r, block_id in enumerate(first_blocks):
            by_pool.setdefault(self.pool_of_block(block_id), []).append(r)
        device = slot_mapping.device
        self._slices = []
        for p, reqs in sorted(by_pool.items()):
            rows = torch.tensor(
                [i for r in reqs for i in range(starts[r], starts[r + 1])], dtype=torch.long, device=device
            )
            counts = torch.tensor([starts[r + 1] - starts[r] for r in reqs], dtype=torch.long)
            qsl = torch.zeros(len(reqs) + 1, dtype=torch.long)
            qsl[1:] = counts.cumsum(0)
            index = torch.tensor(reqs, dtype=torch.long, device=device)
            slots = slot_mapping[rows]
            local_slots = torch.where(slots >= 0, slots - self.offsets[p] * self.block_size, slots)
            self._slices.append(
                _PoolSlice(
                    p,
                    rows,
                    local_slots,
                    block_tables[index] - self.offsets[p],
                    seq_lens[index],
                    qsl.to(device),
                )
            )

    def write_and_attend(
        self,
        layer_idx: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_kv: torch.Tensor,
        kv_b_weight: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        """Write layer `layer_idx`'s `latent_kv [num_tokens, kv_dim]` into each request's pool and attend;
        returns `[num_tokens, H, v_head_dim]` in `q_nope.dtype` (rows of no request stay zero).
        """
        num_tokens, num_heads, qk_nope_head_dim = q_nope.shape
        v_head_dim = kv_b_weight.shape[0] // num_heads - qk_nope_head_dim
        out = q_nope.new_zeros(num_tokens, num_heads, v_head_dim)
        for s in self._slices:
            cache, scale = self.caches[s.pool][layer_idx], self.scales[s.pool][layer_idx]
            write_kv(cache, latent_kv[s.rows], s.slot_mapping, scale)
            out[s.rows] = paged_mla_attention(
                q_nope[s.rows],
                q_pe[s.rows],
                cache,
                s.block_tables,
                s.seq_lens,
                s.query_start_loc,
                kv_b_weight,
                softmax_scale,
                kv_scale=scale,
            )
        return out
