"""Paged KV-cache block manager with prefix caching (vLLM v1 `KVCacheManager`, nano-vllm `BlockManager`)."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from pdcluster.engine.request import Request

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: sha256 over the parent block's hash (none for the first block) and the
    block's token ids as little-endian int64.
    """
    return hashlib.sha256((parent_hash or b"") + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def compute_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class ComputedBlocks(NamedTuple):
    """Result of a prefix-cache lookup (`BlockManager.get_computed_blocks`)."""

    block_ids: list[int]
    block_hashes: list[BlockHash]
    num_cached_tokens: int
    num_evictable_blocks: int


NO_COMPUTED_BLOCKS = ComputedBlocks([], [], 0, 0)
_NO_BLOCKS: list[int] = []


class BlockManager:
    """Block tables, reference counts and the prefix cache for one KV cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block_id: dict[BlockHash, int] = {}
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._deferred: list[int] | None = None
        self._req_to_block_ids: dict[str, list[int]] = {}
        # Chained hashes of each request's leading full committed blocks (its hashed prefix).
        self._req_to_block_hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including evictable cached ones."""
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - len(self._free_block_ids) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._hash_to_block_id)

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (a copy; empty when it holds none)."""
        return list(self._req_to_block_ids.get(request.request_id, ()))

    def block_table(self, request_id: str) -> list[int]:
        """The request's block table itself (not a copy: read it, never change it); empty when none."""
        return self._req_to_block_ids.get(request_id, _NO_BLOCKS)

    def num_blocks_held(self, request: Request) -> int:
        return len(self._req_to_block_ids.get(request.request_id, ()))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_exclusive_blocks(self, request: Request) -> int:
        """Blocks only this request holds: what freeing it returns to the free pool."""
        return sum(self._ref_counts[b] == 1 for b in self._req_to_block_ids.get(request.request_id, ()))

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """Cache slot `block_id * block_size + offset` of each token position in [start, end).
        Raises ValueError: when the positions are not all covered by the request's block table."""
        table = self._req_to_block_ids.get(request.request_id, [])
        if not 0 <= start <= end <= len(table) * self.block_size:
            raise ValueError(
                f"positions [{start}, {end}) of request {request.request_id!r} are outside its "
                f"{len(table)} blocks of {self.block_size} slots"
            )
        bs = self.block_size
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of the request's leading full blocks found in the prefix cache (none for a request
        asking for prompt logprobs: cached positions have no hidden states, `engine.prompt_logprobs`)."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return NO_COMPUTED_BLOCKS
        tokens, bs = request.all_token_ids, self.block_size
        block_ids: list[int] = []
        hashes: list[BlockHash] = []
        parent = None
        for i in range((request.num_tokens - 1) // bs):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            block_id = self._hash_to_block_id.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        num_evictable = sum(self._ref_counts[b] == 0 for b in block_ids)
        return ComputedBlocks(block_ids, hashes, len(block_ids) * bs, num_evictable)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = NO_COMPUTED_BLOCKS
    ) -> bool:
        """Grow the request's block table to cover `num_computed_tokens + num_cached + num_new_tokens` slots.
        Raises ValueError: `computed` given for a request that already holds blocks or computed tokens;
        RuntimeError: a block in `computed` was evicted or re-hashed since the lookup."""
        request_id, bs = request.request_id, self.block_size
        table = self._req_to_block_ids.get(request_id, [])
        num_total_tokens = request.num_computed_tokens + computed.num_cached_tokens + num_new_tokens
        if table and not computed.block_ids and len(table) * bs >= num_total_tokens:
            return True  # the slots are already held
        if computed.block_ids and (table or request.num_computed_tokens):
            raise ValueError(f"request {request_id!r} already holds blocks; cached blocks are for new ones")
        for block_id, block_hash in zip(computed.block_ids, computed.block_hashes, strict=True):
            if self._block_hash[block_id] != block_hash:
                raise RuntimeError(f"stale prefix-cache lookup: block {block_id} changed since the lookup")

        num_required_blocks = -(-num_total_tokens // bs)
        num_fresh_blocks = max(0, num_required_blocks - len(table) - len(computed.block_ids))
        num_evictable = sum(self._ref_counts[b] == 0 for b in computed.block_ids)
        if num_fresh_blocks + num_evictable > len(self._free_block_ids):
            return False

        for block_id in computed.block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_block_ids[block_id]
            self._ref_counts[block_id] += 1
            table.append(block_id)
        for _ in range(num_fresh_blocks):
            block_id, _ = self._free_block_ids.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            table.append(block_id)
        self._req_to_block_ids[request_id] = table
        self._req_to_block_hashes.setdefault(request_id, []).extend(computed.block_hashes)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed, committed blocks in the prefix cache."""
        if not self.enable_prefix_caching or request.request_id not in self._req_to_block_ids:
            return
        hashes = self._req_to_block_hashes[request.request_id]
        bs = self.block_size
        num_full_blocks = min(request.num_computed_tokens, request.num_tokens) // bs
        if num_full_blocks <= len(hashes):
            return
        table, tokens = self._req_to_block_ids[request.request_id], request.all_token_ids
        assert num_full_blocks <= len(table), "computed tokens outside the block table"
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
            block_id = table[i]
            if self._block_hash[block_id] is None and parent not in self._hash_to_block_id:
                self._block_hash[block_id] = parent
                self._hash_to_block_id[parent] = block_id

    def trim(self, request: Request, num_tokens: int) -> None:
        """Shrink the block table to the blocks covering `num_tokens` slots, freeing the trailing ones.
        Raises ValueError: when `num_tokens` would cut into the request's cached (committed, full) blocks."""
        table = self._req_to_block_ids.get(request.request_id, [])
        num_hashed = len(self._req_to_block_hashes.get(request.request_id, ()))
        if num_tokens < num_hashed * self.block_size:
            raise ValueError(
                f"cannot trim request {request.request_id!r} to {num_tokens} tokens: its first "
                f"{num_hashed} blocks hold committed, cached tokens"
            )
        num_keep = -(-num_tokens // self.block_size)
        while len(table) > num_keep:
            self._release(table.pop())

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (tail first); cached ones stay in the cache until evicted."""
        table = self._req_to_block_ids.pop(request.request_id, [])
        self._req_to_block_hashes.pop(request.request_id, None)
        for block_id in reversed(table):
            self._release(block_id)

    def defer_frees(self) -> list[int]:
        """From now on, blocks without cached content that drop to no reference are held out of the free pool
        in the returned list (a step in flight may still write them: `engine.async_loop`) until
        `release_deferred` of it; a later call starts a new list.
        """
        self._deferred = []
        return self._deferred

    def release_deferred(self, block_ids: list[int], stop: bool = False) -> None:
        """Put the blocks of a `defer_frees` list in the free pool (no content: reused first); `stop` ends
        deferring too.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                self._free_block_ids[block_id] = None
                self._free_block_ids.move_to_end(block_id, last=False)
        block_ids.clear()
        if stop:
            self._deferred = None

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        assert self._ref_counts[block_id] >= 0, f"block {block_id} released twice"
        if self._ref_counts[block_id] == 0:
            if self._deferred is not None and self._block_hash[block_id] is None:
                self._deferred.append(block_id)
                return
            self._free_block_ids[block_id] = None
            if self._block_hash[block_id] is None:
                self._free_block_ids.move_to_end(block_id, last=False)

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._hash_to_block_id[block_hash]
            self._block_hash[block_id] = None

    def check_invariants(self) -> None:
        """Assert reference counts equal block-table membership, the free pool is exactly the unreferenced
        blocks, and the hash map and per-block hashes agree.
        """
        counts = [0] * self.num_blocks
        for request_id, table in self._req_to_block_ids.items():
            assert len(set(table)) == len(table), f"request {request_id!r} holds a block twice"
            assert len(self._req_to_block_hashes[request_id]) <= len(table)
            for block_id in table:
                counts[block_id] += 1
        assert counts == self._ref_counts, "reference counts disagree with the block tables"
        free = {b for b in range(self.num_blocks) if counts[b] == 0}
        pooled = set(self._free_block_ids) | set(self._deferred or ())
        assert pooled == free, "free pool (and deferred frees) disagree with the reference counts"
        for block_hash, block_id in self._hash_to_block_id.items():
            assert self._block_hash[block_id] == block_hash, f"block {block_id} hash mismatch"
        assert sum(h is not None for h in self._block_hash) == len(self._hash_to_block_id)

    def check_no_leaks(self) -> None:
        """Assert the allocator is empty: no request holds blocks, every reference count is zero and every
        block is in the free pool.
        """
        problems = []
        if self._req_to_block_ids or self._req_to_block_hashes:
            problems.append(f"requests still hold blocks: {sorted(self._req_to_block_ids)}")
        held = [b for b, count in enumerate(self._ref_counts) if count]
        if held:
            problems.append(f"blocks with nonzero reference counts: {held[:16]}")
        if len(self._free_block_ids) != self.num_blocks:
            problems.append(
                f"{self.num_blocks - len(self._free_block_ids)} blocks missing from the free pool"
            )
        if problems:
            raise AssertionError("KV block leak: " + "; ".join(problems))
