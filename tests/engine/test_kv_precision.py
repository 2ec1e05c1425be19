"""KV precision by sequence length (issue 38, item 1): the pure policy, block pools of several dtypes, and
mixed-dtype batches whose requests each generate what an engine of their dtype alone generates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdcluster.engine.kv_pools import PooledBlockManager
from pdcluster.engine.kv_precision import KVBand, KVPrecisionPolicy
from pdcluster.engine.llm import LLM
from pdcluster.engine.request import RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels.kv_quant import kv_cache_bytes_per_token
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_token_prompts

CKPT = bundled_checkpoint_dir()
# Bands scaled to small requests: up to 48 tokens int8, up to 96 bfloat16, longer float32 with layer 0
# in bfloat16 (a per-layer range).
POLICY = KVPrecisionPolicy(
    (
        KVBand(48, "int8"),
        KVBand(96, "bfloat16"),
        KVBand(None, "float32", key_layers=(0, 0), key_layers_dtype="bfloat16"),
    )
)


def test_band_of_admission_length():
    assert [POLICY.band_index(n) for n in (1, 48, 49, 96, 97, 10_000)] == [0, 0, 1, 1, 2, 2]
    pools, band_to_pool = POLICY.pools(5, torch.float32)
    assert band_to_pool == [0, 1, 2]
    assert pools[2] == (torch.bfloat16,) + (torch.float32,) * 4
    same = KVPrecisionPolicy((KVBand(10, "auto"), KVBand(None, "float32")))
    assert same.pools(5, torch.float32)[1] == [0, 0]  # equal dtypes share one pool
    with pytest.raises(ValueError, match="must increase"):
        KVPrecisionPolicy((KVBand(20, "int8"), KVBand(10, "int8"), KVBand(None, "auto")))
    with pytest.raises(ValueError, match="only the last band is unbounded"):
        KVPrecisionPolicy((KVBand(20, "int8"),))


def test_kv_bytes_per_token_by_band_exact():
    """The tiny model: kv_dim 64 + 16 = 80, 4 main + 1 MTP layers."""
    kv_dim, layers = 80, 5
    assert POLICY.bytes_per_token(0, kv_dim, layers, torch.float32) == 5 * (80 + 4)  # int8 + fp32 scale
    assert POLICY.bytes_per_token(1, kv_dim, layers, torch.float32) == 5 * 80 * 2
    assert POLICY.bytes_per_token(2, kv_dim, layers, torch.float32) == 80 * 2 + 4 * 80 * 4
    assert POLICY.bytes_per_token(0, kv_dim, layers, torch.float32) == kv_cache_bytes_per_token(
        kv_dim, torch.int8, layers
    )


def test_pooled_block_manager_keeps_pools_and_prefix_hits_apart(make_request):
    bm = PooledBlockManager([4, 6], block_size=4)
    a, b = make_request("a", prompt=list(range(9)), max_tokens=3), make_request("b", prompt=list(range(9)))
    b.kv_pool = 1
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 9)
    assert bm.block_ids(a) == [0, 1, 2] and bm.block_ids(b) == [4, 5, 6]
    assert bm.slot_mapping(b, 0, 2) == [16, 17]
    assert bm.num_free_blocks_per_pool == [1, 3]
    for r in (a, b):
        r.num_computed_tokens = 9
        bm.cache_full_blocks(r)
    same_tokens = make_request("c", prompt=list(range(9)))
    same_tokens.kv_pool = 1
    hit = bm.get_computed_blocks(same_tokens)
    assert hit.block_ids == [4, 5]  # pool 1's blocks only: same dtype
    assert bm.allocate_slots(same_tokens, 1, hit) and bm.block_ids(same_tokens)[:2] == [4, 5]
    assert bm.ref_count(4) == 2 and bm.ref_count(0) == 1
    for r in (a, b, same_tokens):
        bm.free(r)
    bm.check_invariants()
    bm.check_no_leaks()


def _lengths() -> list[int]:
    # (prompt, max_tokens): 20+16=36 int8, 40+8=48 int8, 50+30=80 bfloat16, 70+20=90 bfloat16,
    # 90+40=130 float32/bf16 layer 0, 120+16=136 float32/bf16 layer 0
    return [(20, 16), (40, 8), (50, 30), (70, 20), (90, 40), (120, 16)]


@pytest.fixture(scope="module")
def mixed() -> LLM:
    return LLM(CKPT, num_kv_blocks=64, block_size=16, kv_precision=POLICY, num_speculative_tokens=1)


def test_mixed_batch_equals_single_dtype_engines(mixed):
    """One batch holds all three dtypes; each request's greedy tokens equal those of an engine that runs
    only its own band's policy (every request in that dtype), in a batch of the same requests."""
    cases = _lengths()
    prompts = heldout_token_prompts(mixed.tokenizer, [n for n, _ in cases])
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in cases]
    outputs = mixed.generate(prompts, params)
    pools = [mixed.engine.kv_layout.pool_for(n, m) for n, m in cases]
    assert pools == [0, 0, 1, 1, 2, 2]
    mixed.engine.scheduler.block_manager.check_no_leaks()
    for band in range(3):
        if band == 0:  # int8: the engine's own single-dtype cache (`kv_cache_dtype`), no pools
            single = mixed.replace_config(kv_precision=None, kv_cache_dtype="int8")
        else:  # 16-bit KV under a float32 model exists only as a policy: one band, one pool
            only = dataclasses.replace(POLICY.bands[band], max_tokens=None)
            single = mixed.replace_config(kv_precision=KVPrecisionPolicy((only,)))
        rows = [i for i, p in enumerate(pools) if p == band]
        alone = single.generate([prompts[i] for i in rows], [params[i] for i in rows])
        for i, out in zip(rows, alone, strict=True):
            assert outputs[i].token_ids == out.token_ids, f"request {i} (band {band}) differs"


def test_pool_tensor_bytes_per_token_equal_the_memory_model(mixed):
    """The engine's pool tensors hold, per token slot, exactly the bytes `planner.memory` counts for the
    band (every layer's values plus the int8 layers' float32 scales)."""
    from pdcluster.planner.memory import kv_bytes_per_token_by_band, request_kv_bytes

    engine = mixed.engine
    cfg, caches = engine.model.config, engine.runner.kv_pools
    model_bytes = kv_bytes_per_token_by_band(cfg, POLICY, "float32")
    for band, pool in enumerate(engine.kv_layout.band_to_pool):
        slots = caches.num_blocks_per_pool[pool] * caches.block_size
        tensors = [t for t in caches.caches[pool] + caches.scales[pool] if t is not None]
        assert sum(t.numel() * t.element_size() for t in tensors) == slots * model_bytes[band]
    assert model_bytes == [5 * (80 + 4), 5 * 80 * 2, 80 * 2 + 4 * 80 * 4]
    # 20 + 16 = 36 tokens in 16-token blocks: 48 slots of the int8 band
    assert request_kv_bytes(cfg, POLICY, "float32", 20, 16, 16) == 48 * 5 * 84


def test_mtp_acceptance_by_the_band_kv_dtype():
    from pdcluster.planner.memory import mtp_acceptance_for_request

    measured = {"int8": 0.63, "bfloat16": 0.7}  # `pdcluster accuracy --json`'s mtp_acceptance_by_kv_dtype
    assert mtp_acceptance_for_request(measured, POLICY, 20, 16, 0.8) == 0.63
    assert mtp_acceptance_for_request(measured, POLICY, 50, 30, 0.8) == 0.7
    assert mtp_acceptance_for_request(measured, POLICY, 200, 30, 0.8) == 0.8  # not measured: the default


def test_scheduler_counts_blocks_per_pool(make_scheduler, make_request):
    """A full pool blocks only its own requests: another pool's request is admitted past one waiting for
    it, and the waiting one is admitted to its own pool once blocks there are freed."""
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)  # block_size 4
    scheduler.block_manager = bm = PooledBlockManager([2, 4], block_size=4)
    first = make_request("a", num_prompt_tokens=8, max_tokens=4)  # 2 blocks: fills pool 0
    waits = make_request("b", num_prompt_tokens=4, max_tokens=4)  # pool 0: no block left
    other = make_request("c", num_prompt_tokens=8, max_tokens=4)
    other.kv_pool = 1
    for r in (first, waits, other):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "c"}  # c overtakes b: b waits on pool 0 only
    assert bm.block_ids(other) == [2, 3] and bm.num_free_blocks_per_pool == [0, 2]
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks_per_pool == [2, 2]
    out = scheduler.schedule()
    assert "b" in out.num_scheduled_tokens and bm.block_ids(waits) == [0]
    assert waits.kv_pool == 0
