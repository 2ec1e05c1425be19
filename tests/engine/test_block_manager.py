"""Block manager: exact block ids for allocation, prefix-cache hits, LRU eviction, trim and leaks.

block_size 4 throughout; fresh blocks come from the front of the free pool (ids ascending at start)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pdcluster.engine.block_manager import BlockManager, compute_block_hashes, hash_block_tokens
from tests.engine.conftest import compute

PROMPT = list(range(100, 116))  # 16 tokens = 4 full blocks


def test_allocate_slot_mapping_free(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    request = make_request(num_prompt_tokens=10)
    assert bm.allocate_slots(request, 10)
    assert bm.block_ids(request) == [0, 1, 2]
    assert bm.slot_mapping(request, 0, 10) == list(range(10))
    assert bm.slot_mapping(request, 8, 12) == [8, 9, 10, 11]
    assert (bm.num_free_blocks, bm.usage) == (5, 3 / 8)
    with pytest.raises(ValueError, match=r"positions \[10, 13\) of request 'r0' are outside its 3 blocks"):
        bm.slot_mapping(request, 10, 13)
    bm.free(request)
    assert (bm.num_free_blocks, bm.usage) == (8, 0.0)
    bm.check_no_leaks()


def test_allocate_fails_without_changing_anything(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    big, small = make_request("big", num_prompt_tokens=28), make_request("small", num_prompt_tokens=5)
    assert bm.allocate_slots(big, 28)
    assert not bm.allocate_slots(small, 5)  # needs 2 blocks, 1 free
    assert (bm.block_ids(small), bm.num_free_blocks) == ([], 1)
    assert bm.allocate_slots(small, 4)
    assert bm.block_ids(small) == [7]
    bm.check_invariants()


def test_slot_mapping_with_scattered_blocks(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_request("a", num_prompt_tokens=4), make_request("b", num_prompt_tokens=6)
    compute(bm, a, 4)
    assert bm.allocate_slots(b, 6)  # blocks 1, 2
    assert bm.slot_mapping(b, 2, 6) == [6, 7, 8, 9]


def test_prefix_hit_shares_exact_blocks(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_request("first", prompt=PROMPT[:12])
    compute(bm, first, 12)
    assert bm.num_cached_blocks == 3
    second = make_request("second", prompt=PROMPT[:8] + [1, 2, 3])
    hit = bm.get_computed_blocks(second)
    assert (hit.block_ids, hit.num_cached_tokens, hit.num_evictable_blocks) == ([0, 1], 8, 0)
    assert bm.num_free_blocks == 5  # lookup mutates nothing
    compute(bm, second, 3, hit)
    assert bm.block_ids(second) == [0, 1, 3]
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert second.num_computed_tokens == 11 and bm.num_blocks_held(second) == 3
    assert bm.num_exclusive_blocks(second) == 1
    bm.free(first)
    bm.free(second)
    bm.check_no_leaks()


def test_last_prompt_token_is_always_recomputed(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, make_request("first", prompt=PROMPT[:12]), 12)
    # Same 12 tokens: the third block would cover the whole prompt, so only 2 blocks hit.
    assert bm.get_computed_blocks(make_request("same", prompt=PROMPT[:12])).num_cached_tokens == 8
    assert bm.get_computed_blocks(make_request("longer", prompt=PROMPT[:13])).num_cached_tokens == 12
    assert bm.get_computed_blocks(make_request("other", prompt=[5] + PROMPT[1:12])).block_ids == []


def test_only_full_committed_blocks_are_cached(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    partial = make_request("partial", prompt=PROMPT[:10])
    compute(bm, partial, 10)
    assert bm.num_cached_blocks == 2  # the half-full third block is not cached
    with_drafts = make_request("drafts", prompt=[1, 2, 3, 4, 5, 6])
    compute(bm, with_drafts, 6)
    with_drafts.spec_token_ids = [7, 8]
    compute(bm, with_drafts, 2)  # slots 6, 7 hold draft KV: block 2 is full, but not of committed tokens
    assert with_drafts.num_computed_tokens == 8 and bm.num_cached_blocks == 3
    with_drafts.append_output_token_ids([7, 8])  # both drafts accepted and committed
    bm.cache_full_blocks(with_drafts)
    assert bm.num_cached_blocks == 4


def test_freed_blocks_stay_cached_and_hit_from_free_pool(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_request("first", prompt=PROMPT[:12])
    compute(bm, first, 12)
    bm.free(first)
    assert (bm.num_free_blocks, bm.num_cached_blocks) == (8, 3)
    second = make_request("second", prompt=PROMPT[:9])
    hit = bm.get_computed_blocks(second)
    assert (hit.block_ids, hit.num_evictable_blocks) == ([0, 1], 2)
    compute(bm, second, 1, hit)
    assert bm.block_ids(second) == [0, 1, 3]  # block 2 (cached, free) is kept; block 3 had no content
    assert bm.num_free_blocks == 5


def test_eviction_takes_empty_blocks_then_lru_prefix_tail_first(make_request):
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_request("a", prompt=PROMPT[:8]), make_request("b", prompt=PROMPT[8:16])
    compute(bm, a, 8)  # blocks 0, 1
    compute(bm, b, 8)  # blocks 2, 3
    bm.free(a)
    bm.free(b)
    # Free pool order: 4, 5 (no content), then a's blocks tail first (1, 0), then b's (3, 2).
    fresh = make_request("fresh", num_prompt_tokens=12)
    assert bm.allocate_slots(fresh, 12)
    assert bm.block_ids(fresh) == [4, 5, 1]
    assert bm.num_cached_blocks == 3
    assert bm.get_computed_blocks(make_request("a2", prompt=PROMPT[:9])).block_ids == [0]
    assert bm.get_computed_blocks(make_request("b2", prompt=PROMPT[8:16] + [0])).block_ids == [2, 3]
    more = make_request("more", num_prompt_tokens=8)
    assert bm.allocate_slots(more, 8)
    assert bm.block_ids(more) == [0, 3]
    bm.check_invariants()


def test_a_hit_refreshes_lru_position(make_request):
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_request("a", prompt=PROMPT[:4]), make_request("b", prompt=PROMPT[4:8])
    compute(bm, a, 4)  # block 0
    compute(bm, b, 4)  # block 1
    bm.free(a)
    bm.free(b)  # pool: 2, 3, 0, 1
    reuse = make_request("reuse", prompt=PROMPT[:5])
    compute(bm, reuse, 1, bm.get_computed_blocks(reuse))  # takes 0 and fresh 2
    bm.free(reuse)  # pool: 2 (no content), 3, 1, 0
    fresh = make_request("fresh", num_prompt_tokens=12)
    assert bm.allocate_slots(fresh, 12)
    assert bm.block_ids(fresh) == [2, 3, 1]  # b's block is older than a's re-used one


def test_duplicate_content_is_registered_once(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_request("a", prompt=PROMPT[:9]), make_request("b", prompt=PROMPT[:9])
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 9)  # same step: neither could hit
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(make_request("c", prompt=PROMPT[:9])).block_ids == [0, 1]
    bm.free(b)  # b's blocks 3, 4, 5 hold nothing cached: reused first
    d = make_request("d", num_prompt_tokens=4)
    assert bm.allocate_slots(d, 4)
    assert bm.block_ids(d) == [3]
    bm.check_invariants()


def test_trim_rolls_back_draft_slots(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    request = make_request(prompt=PROMPT[:8])
    compute(bm, request, 8)
    request.append_output_token_ids([1])
    request.spec_token_ids = [2, 3, 4]
    request.num_computed_tokens = 8
    assert bm.allocate_slots(request, 4)  # slots 8..11 -> third block
    assert bm.block_ids(request) == [0, 1, 2]
    bm.trim(request, 9)
    assert bm.block_ids(request) == [0, 1, 2]
    bm.trim(request, 8)
    assert bm.block_ids(request) == [0, 1] and bm.ref_count(2) == 0 and bm.num_free_blocks == 6
    with pytest.raises(ValueError, match="cannot trim request 'r0' to 7 tokens: its first 2 blocks hold"):
        bm.trim(request, 7)
    bm.check_invariants()


def test_trim_never_touches_shared_cached_blocks(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    owner = make_request("owner", prompt=PROMPT[:9])
    compute(bm, owner, 9)
    sharer = make_request("sharer", prompt=PROMPT[:8] + [0])
    compute(bm, sharer, 1, bm.get_computed_blocks(sharer))
    assert bm.block_ids(sharer) == [0, 1, 3]
    bm.trim(sharer, 8)
    assert bm.block_ids(sharer) == [0, 1]
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 1, 0]
    with pytest.raises(ValueError, match="cannot trim"):
        bm.trim(sharer, 4)


def test_stale_lookup_is_detected(make_request):
    bm = BlockManager(num_blocks=3, block_size=4)
    first = make_request("first", prompt=PROMPT[:8])
    compute(bm, first, 8)
    bm.free(first)
    later = make_request("later", prompt=PROMPT[:9])
    hit = bm.get_computed_blocks(later)
    assert hit.block_ids == [0, 1]
    compute(bm, make_request("evictor", num_prompt_tokens=12), 12)  # evicts both cached blocks
    with pytest.raises(RuntimeError, match="stale prefix-cache lookup: block 0"):
        bm.allocate_slots(later, 1, hit)


def test_cached_blocks_only_for_a_request_without_blocks(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, make_request("first", prompt=PROMPT[:8]), 8)
    request = make_request("second", prompt=PROMPT[:9])
    hit = bm.get_computed_blocks(request)
    compute(bm, request, 1, hit)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_slots(request, 1, hit)


def test_prefix_caching_disabled(make_request):
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    compute(bm, make_request("first", prompt=PROMPT[:12]), 12)
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(make_request("second", prompt=PROMPT[:12])).num_cached_tokens == 0


def test_leak_check_reports_held_blocks(make_request):
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_slots(make_request("leaky", num_prompt_tokens=5), 5)
    with pytest.raises(AssertionError, match=r"requests still hold blocks: \['leaky'\]; .*\[0, 1\]"):
        bm.check_no_leaks()


def test_block_hashes_are_chained_and_deterministic():
    hashes = compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(hashes) == 2 and all(len(h) == 32 for h in hashes)
    assert hashes[1] == hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert compute_block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != hashes[1]  # the prefix is in the hash
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hashlib.sha256(struct.pack("<4q", 1, 2, 3, 4)).digest()
