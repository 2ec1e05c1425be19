"""KV cache blocks of more than one dtype: one block pool per KV precision (`engine.kv_precision`).

Separate pools, not a dtype per block: a block's bytes per slot differ by precision (int8 values plus a
float32 scale per token, 16-bit, float32, or a mix per layer), so one tensor per layer cannot hold blocks
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from pdcluster.engine.block_manager import NO_COMPUTED_BLOCKS, BlockManager, ComputedBlocks
from pdcluster.engine.kv_precision import KVPrecisionPolicy, LayerDtypes, admission_length
from pdcluster.engine.request import Request
from pdcluster.kernels.kv_quant import kv_cache_bytes_per_token


def pool_bytes_per_token(kv_dim: int, layer_dtypes: LayerDtypes) -> int:
    """KV bytes one token occupies in a pool with these per-layer dtypes (int8 scales included)."""
    return sum(kv_cache_bytes_per_token(kv_dim, d, 1) for d in layer_dtypes)


def pool_num_blocks(memory_bytes: int, pools: list[LayerDtypes], kv_dim: int, block_size: int) -> list[int]:
    """Blocks of each pool when `memory_bytes` is split into equal shares, one per pool (>= 1 each)."""
    share = memory_bytes // len(pools)
    return [max(1, share // (pool_bytes_per_token(kv_dim, p) * block_size)) for p in pools]


class PooledBlockManager:
    """One `BlockManager` per pool behind global block ids (see the module docstring)."""

    def __init__(self, num_blocks_per_pool: list[int], block_size: int, enable_prefix_caching: bool = True):
        if not num_blocks_per_pool:
            raise ValueError("PooledBlockManager needs at least one pool")
        self.pools = [BlockManager(n, block_size, enable_prefix_caching) for n in num_blocks_per_pool]
        self.offsets = [0, *itertools.accumulate(num_blocks_per_pool)][:-1]
        self.num_blocks = sum(num_blocks_per_pool)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    def pool_of(self, request: Request) -> int:
        """The request's pool; ValueError when it names none."""
        if not 0 <= request.kv_pool < len(self.pools):
            raise ValueError(
                f"request {request.request_id!r}: KV pool {request.kv_pool} of {len(self.pools)}"
            )
        return request.kv_pool

    def pool_of_block(self, block_id: int) -> int:
        for p in range(len(self.pools) - 1, -1, -1):
            if block_id >= self.offsets[p]:
                return p
        raise ValueError(f"block id {block_id} < 0")

    @property
    def num_free_blocks_per_pool(self) -> list[int]:
        return [bm.num_free_blocks for bm in self.pools]

    def _bm(self, request: Request) -> tuple[BlockManager, int]:
        p = self.pool_of(request)
        return self.pools[p], self.offsets[p]

    @property
    def num_free_blocks(self) -> int:
        return sum(self.num_free_blocks_per_pool)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(bm.num_cached_blocks for bm in self.pools)

    def block_ids(self, request: Request) -> list[int]:
        bm, offset = self._bm(request)
        return [offset + b for b in bm.block_ids(request)]

    def num_blocks_held(self, request: Request) -> int:
        return self._bm(request)[0].num_blocks_held(request)

    def num_exclusive_blocks(self, request: Request) -> int:
        return self._bm(request)[0].num_exclusive_blocks(request)

    def ref_count(self, block_id: int) -> int:
        p = self.pool_of_block(block_id)
        return self.pools[p].ref_count(block_id - self.offsets[p])

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        bm, offset = self._bm(request)
        return [s + offset * self.block_size for s in bm.slot_mapping(request, start, end)]

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        bm, offset = self._bm(request)
        local = bm.get_computed_blocks(request)
        return local._replace(block_ids=[offset + b for b in local.block_ids])

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = NO_COMPUTED_BLOCKS
    ) -> bool:
        bm, offset = self._bm(request)
        if computed.block_ids:
            computed = computed._replace(block_ids=[b - offset for b in computed.block_ids])
        return bm.allocate_slots(request, num_new_tokens, computed)

    def cache_full_blocks(self, request: Request) -> None:
        self._bm(request)[0].cache_full_blocks(request)

    def trim(self, request: Request, num_tokens: int) -> None:
        self._bm(request)[0].trim(request, num_tokens)

    def free(self, request: Request) -> None:
        self._bm(request)[0].free(request)

    def check_invariants(self) -> None:
        for bm in self.pools:
            bm.check_invariants()

    def check_no_leaks(self) -> None:
        for p, bm in enumerate(self.pools):
            try:
                bm.check_no_leaks()
            except AssertionError as exc:
                raise AssertionError(f"pool {p}: {exc}") from None


class KVPoolLayout(NamedTuple):
    """An engine's pools under a policy: each pool's per-layer dtypes and blocks, each band's pool."""

    policy: KVPrecisionPolicy
    pools: list[LayerDtypes]
    band_to_pool: list[int]
    num_blocks_per_pool: list[int]

    @classmethod
    def build(
        cls,
        policy: KVPrecisionPolicy,
        num_layers: int,
        model_dtype: torch.dtype,
        kv_dim: int,
        block_size: int,
        memory_bytes: int,
        num_blocks: int | None = None,
    ) -> KVPoolLayout:
        """`num_blocks` given: that many blocks in every pool; else `memory_bytes` split equally."""
        pools, band_to_pool = policy.pools(num_layers, model_dtype)
        counts = (
            [num_blocks] * len(pools)
            if num_blocks
            else pool_num_blocks(memory_bytes, pools, kv_dim, block_size)
        )
        return cls(policy, pools, band_to_pool, counts)

    def pool_for(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The pool of a request with this prompt length and `max_tokens` (its band's)."""
        return self.band_to_pool[self.policy.band_index(admission_length(num_prompt_tokens, max_tokens))]
