"""Router policies are pure functions over load snapshots; the prefix-aware policy's cache model (per
prefill rank); an instance's loads, one per rank, and the choice of (instance, rank)."""

from __future__ import annotations

import pytest

from pdcluster.driver.instance import decode_rank_loads, prefill_rank_loads
from pdcluster.driver.messages import DecodeNodeLoad, PrefillNodeLoad
from pdcluster.driver.router import (
    DecodeLoad,
    PrefillLoad,
    PrefixCacheModel,
    RankRef,
    RouteChoice,
    least_loaded,
    prefix_aware,
    round_robin,
)
from pdcluster.engine.block_manager import compute_block_hashes


def _pair(choice: RouteChoice) -> tuple[int, int]:
    assert choice.prefill.rank == 0 and choice.decode.rank == 0  # single-rank instances
    return choice.prefill.instance, choice.decode.instance


def test_round_robin_cycles_both_pools() -> None:
    p = [PrefillLoad(0, 0), PrefillLoad(1, 0)]
    d = [DecodeLoad(0, 10, 0), DecodeLoad(1, 10, 0), DecodeLoad(2, 10, 0)]
    assert [_pair(round_robin(p, d, counter=c)) for c in range(3)] == [(0, 0), (1, 1), (0, 2)]


def test_least_loaded_prefers_short_queue_and_free_blocks() -> None:
    p = [PrefillLoad(0, 500), PrefillLoad(1, 20)]
    d = [DecodeLoad(0, 10, 1), DecodeLoad(1, 30, 5), DecodeLoad(2, 30, 2)]
    assert _pair(least_loaded(p, d)) == (1, 2)


def test_choices_name_pool_indices_not_list_positions() -> None:
    """With instances out of routing the loads are a subset: the choice names the instances' pool
    indices (prefill-1 and decode-2 here), not their positions in the lists."""
    p = [PrefillLoad(1, 5), PrefillLoad(3, 50)]
    d = [DecodeLoad(2, 30, 0), DecodeLoad(4, 10, 0)]
    assert least_loaded(p, d) == RouteChoice(RankRef(1, 0), RankRef(2, 0))
    assert _pair(round_robin(p, d, counter=1)) == (3, 4)


def test_prefix_aware_trades_queue_against_cache_hits() -> None:
    prompt = list(range(100, 165))  # 4 full blocks of 16 before the last token
    cached = frozenset(compute_block_hashes(prompt, 16))
    p = [PrefillLoad(0, 10), PrefillLoad(1, 40, cached)]
    d = [DecodeLoad(0, 10, 0)]
    assert prefix_aware(p, d, prompt_token_ids=prompt, block_size=16).prefill.instance == 1
    p = [PrefillLoad(0, 10), PrefillLoad(1, 100, cached)]
    assert prefix_aware(p, d, prompt_token_ids=prompt, block_size=16).prefill.instance == 0


def test_prefix_cache_model_remembers_sent_prompts_and_forgets_the_oldest() -> None:
    model = PrefixCacheModel(block_size=4, capacity_blocks=3)
    first, second = list(range(8)), list(range(100, 108))  # 2 full blocks each
    p0, p1 = RankRef(0), RankRef(1)
    model.record(p0, first)
    assert model.cached(p0) == frozenset(compute_block_hashes(first, 4))
    assert model.cached(p1) == frozenset()
    assert model.cached(RankRef(0, 1)) == frozenset()  # another rank of prefill-0: its own cache
    model.record(p0, second)  # 4 blocks > capacity 3: the oldest (first's first block) is forgotten
    kept = compute_block_hashes(first, 4)[1:] + compute_block_hashes(second, 4)
    assert model.cached(p0) == frozenset(kept)
    model.record(p0, second[:4])  # sent again: most recent now, so first's second block is the oldest
    model.record(p0, first[:4])  # a new block in: first's second block goes
    first_blocks, second_blocks = compute_block_hashes(first, 4), compute_block_hashes(second, 4)
    assert model.cached(p0) == frozenset([first_blocks[0], *second_blocks])
    # the router's view feeds prefix_aware: prefill-1 knows nothing, prefill-0 caches `second`
    loads = [PrefillLoad(i, 0, model.cached(RankRef(i))) for i in range(2)]
    choice = prefix_aware(loads, [DecodeLoad(0, 1, 0)], prompt_token_ids=second + [9], block_size=4)
    assert choice.prefill == RankRef(0, 0)
    choice = prefix_aware(loads, [DecodeLoad(0, 1, 0)], prompt_token_ids=list(range(50, 59)), block_size=4)
    assert choice.prefill == RankRef(0, 0)  # no hit anywhere: the tie goes to the lower index


HEALTHY = dict(engine_thread_alive=True, num_engine_errors=0, last_engine_error=None)


def _decode_rank(free: int, running: int, reserved: int = 0, waiting: int = 0) -> DecodeNodeLoad:
    return DecodeNodeLoad(
        **HEALTHY, name="decode-0", pid=1, num_free_blocks=free, num_total_blocks=100, num_running=running,
        num_reserved=reserved, num_waiting_for_seat=waiting,
    )  # fmt: skip


def test_an_instance_reports_one_load_per_rank() -> None:
    assert decode_rank_loads(3, [_decode_rank(40, 1, 1, 1)]) == [DecodeLoad(3, 40, 3)]
    ranks = [_decode_rank(40, 1), _decode_rank(25, 4, 1)]
    assert decode_rank_loads(1, ranks) == [DecodeLoad(1, 40, 1, 0), DecodeLoad(1, 25, 5, 1)]
    prefill = [
        PrefillNodeLoad(**HEALTHY, name="prefill-2", pid=7, num_queued_prefill_tokens=n, num_requests=1)
        for n in (30, 80)
    ]
    cached = {RankRef(2, 1): frozenset({b"x"})}
    loads = prefill_rank_loads(2, prefill, lambda ref: cached.get(ref, frozenset()))
    assert loads == [PrefillLoad(2, 30, frozenset(), 0), PrefillLoad(2, 80, frozenset({b"x"}), 1)]


def test_the_policies_pick_a_rank_by_its_own_load() -> None:
    """Attention is data-parallel over an instance's ranks: the decode choice is the rank with the most
    free KV blocks (then the smallest batch), the prefill choice the rank with the shortest queue, and
    round robin cycles over every rank listed."""
    p = [PrefillLoad(0, 90, rank=0), PrefillLoad(0, 10, rank=1)]
    d = [DecodeLoad(0, 30, 4, rank=0), DecodeLoad(0, 30, 2, rank=1), DecodeLoad(1, 20, 0, rank=0)]
    assert least_loaded(p, d) == RouteChoice(RankRef(0, 1), RankRef(0, 1))
    d = [DecodeLoad(0, 30, 4, rank=0), DecodeLoad(0, 50, 9, rank=1), DecodeLoad(1, 20, 0, rank=0)]
    assert least_loaded(p, d).decode == RankRef(0, 1)  # free blocks first
    choices = [round_robin(p, d, counter=c) for c in range(3)]
    assert [c.decode for c in choices] == [RankRef(0, 0), RankRef(0, 1), RankRef(1, 0)]
    assert [c.prefill for c in choices] == [RankRef(0, 0), RankRef(0, 1), RankRef(0, 0)]


def test_no_live_instance_is_an_error() -> None:
    with pytest.raises(ValueError, match="prefill"):
        least_loaded([], [DecodeLoad(0, 1, 0)])
