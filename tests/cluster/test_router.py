"""Router policies are pure functions over load snapshots."""

from __future__ import annotations

import pytest

from engine.block_manager import compute_block_hashes
from orchestrator.router import DecodeLoad, PrefillLoad, least_loaded, prefix_aware, round_robin


def test_round_robin_cycles_both_pools() -> None:
    p = [PrefillLoad(0, 0), PrefillLoad(1, 0)]
    d = [DecodeLoad(0, 10, 0), DecodeLoad(1, 10, 0), DecodeLoad(2, 10, 0)]
    assert [tuple(round_robin(p, d, counter=c)) for c in range(3)] == [(0, 0), (1, 1), (0, 2)]


def test_least_loaded_prefers_short_queue_and_free_blocks() -> None:
    p = [PrefillLoad(0, 500), PrefillLoad(1, 20)]
    d = [DecodeLoad(0, 10, 1), DecodeLoad(1, 30, 5), DecodeLoad(2, 30, 2)]
    assert tuple(least_loaded(p, d)) == (1, 2)


def test_prefix_aware_trades_queue_against_cache_hits() -> None:
    prompt = list(range(100, 165))  # 4 full blocks of 16 before the last token
    cached = frozenset(compute_block_hashes(prompt, 16))
    p = [PrefillLoad(0, 10), PrefillLoad(1, 40, cached)]
    d = [DecodeLoad(0, 10, 0)]
    assert prefix_aware(p, d, prompt_token_ids=prompt, block_size=16).prefill_index == 1
    p = [PrefillLoad(0, 10), PrefillLoad(1, 100, cached)]
    assert prefix_aware(p, d, prompt_token_ids=prompt, block_size=16).prefill_index == 0


def test_no_live_instance_is_an_error() -> None:
    with pytest.raises(ValueError, match="prefill"):
        least_loaded([], [DecodeLoad(0, 1, 0)])
