"""Re-placing experts on the surviving ranks of an EP instance (models.elastic_placement)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdcluster.models.elastic_placement import PlacementRefused, shrink_placement
from pdcluster.models.expert_placement import ExpertPlacement

NUM_LAYERS, NUM_LOGICAL = 3, 8


def _held(placement: ExpertPlacement, row: int, rank: int) -> list[int]:
    return placement.local_logical_experts(row, rank)


@pytest.mark.parametrize("num_ranks,num_redundant", [(2, 8), (4, 4), (4, 8)])
def test_any_single_rank_loss_keeps_a_replica_of_every_expert(num_ranks: int, num_redundant: int) -> None:
    placement = ExpertPlacement.default(NUM_LAYERS, NUM_LOGICAL, num_ranks, num_redundant)
    load = torch.arange(1, NUM_LAYERS * NUM_LOGICAL + 1, dtype=torch.float32).view(NUM_LAYERS, NUM_LOGICAL)
    for lost in range(num_ranks):
        shrunk = shrink_placement(placement, {lost}, load)
        new = shrunk.placement
        assert shrunk.survivors == tuple(r for r in range(num_ranks) if r != lost)
        assert new.num_ranks == num_ranks - 1
        assert (new.logcnt >= 1).all()
        for row in range(NUM_LAYERS):
            orphans = set(range(NUM_LOGICAL)) - {
                e for old in shrunk.survivors for e in _held(placement, row, old)
            }
            loaded = [(rank, slot, e) for r, rank, slot, e in shrunk.loads if r == row]
            assert sorted(e for _, _, e in loaded) == sorted(orphans)  # only orphans come from the checkpoint
            for new_rank, old_rank in enumerate(shrunk.survivors):  # every other slot keeps its expert
                before, after = _held(placement, row, old_rank), _held(new, row, new_rank)
                moved = {slot for rank, slot, _ in loaded if rank == new_rank}
                assert [e for s, e in enumerate(after) if s not in moved] == [
                    e for s, e in enumerate(before) if s not in moved
                ]


def test_two_losses_one_after_the_other() -> None:
    placement = ExpertPlacement.default(NUM_LAYERS, NUM_LOGICAL, 4, 8)  # 4 slots per rank
    first = shrink_placement(placement, {1})
    second = shrink_placement(first.placement, {0})
    assert second.placement.num_ranks == 2
    assert (second.placement.logcnt >= 1).all()
    assert [first.survivors[r] for r in second.survivors] == [2, 3]


def test_an_orphan_takes_the_copy_whose_loss_costs_least() -> None:
    # EP2, 3 logical experts: rank 0 holds [0, 1, 0, 1], rank 1 holds four copies of expert 2.
    placement = ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 0, 1, 2, 2, 2, 2]]), 3, 2)
    load = torch.tensor([[100.0, 1.0, 5.0]])  # expert 0 is hot: its second copy must stay
    shrunk = shrink_placement(placement, {1}, load)
    assert _held(shrunk.placement, 0, 0) == [0, 2, 0, 1]  # expert 2 replaced a copy of cold expert 1
    assert shrunk.loads == ((0, 0, 1, 2),)


def test_too_few_slots_is_a_clear_refusal_unless_survivors_may_grow() -> None:
    placement = ExpertPlacement.default(NUM_LAYERS, NUM_LOGICAL, 2, 2)  # 5 slots per rank
    with pytest.raises(PlacementRefused, match=r"1 surviving ranks × 5 expert slots cannot hold 8"):
        shrink_placement(placement, {0})
    grown = shrink_placement(placement, {0}, max_local_experts=8)
    assert grown.placement.num_local_experts == 8
    assert sorted(_held(grown.placement, 0, 0)) == list(range(NUM_LOGICAL))
    assert len(grown.loads) == NUM_LAYERS * 3  # the 3 experts rank 1 held alone


def test_grown_slots_beyond_the_orphans_hold_copies_of_the_hottest_expert() -> None:
    placement = ExpertPlacement.default(1, 5, 3, 1)  # ranks hold [0, 1], [2, 3], [4, 0]
    load = torch.tensor([[1.0, 9.0, 1.0, 1.0, 1.0]])
    shrunk = shrink_placement(placement, {0}, load, max_local_experts=3)  # 2 survivors × 3 slots
    assert shrunk.placement.num_local_experts == 3
    assert _held(shrunk.placement, 0, 0) == [2, 3, 1]  # the orphan, on the least-loaded survivor
    assert _held(shrunk.placement, 0, 1) == [4, 0, 1]  # the spare slot: another copy of the hottest


@pytest.mark.parametrize("lost", [set(), {0, 1}, {5}])
def test_bad_lost_ranks_are_refused(lost: set[int]) -> None:
    placement = ExpertPlacement.default(1, 4, 2, 0)
    with pytest.raises(ValueError):
        shrink_placement(placement, lost)


def test_a_load_of_the_wrong_shape_is_refused() -> None:
    placement = ExpertPlacement.default(2, 4, 2, 2)
    with pytest.raises(ValueError, match=r"expert_load must be \[2, 4\]"):
        shrink_placement(placement, {0}, torch.ones(4))


def test_every_pair_of_losses_on_ep4_with_enough_redundancy() -> None:
    placement = ExpertPlacement.default(NUM_LAYERS, NUM_LOGICAL, 4, 8)  # 16 physical, 4 per rank
    for lost in itertools.combinations(range(4), 2):
        assert (shrink_placement(placement, set(lost)).placement.logcnt >= 1).all()
