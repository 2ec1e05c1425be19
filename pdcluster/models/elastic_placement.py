"""Expert placement after EP ranks are lost, moving as few experts as it can (elastic EP).

Survivors keep their experts and grow only the slots every expert needs (at most `max_local_experts`, else
refused). Each expert left with no replica (an orphan) is read from the checkpoint into an empty grown slot
of the least-loaded survivor, else into the redundant replica's slot whose loss costs least.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.models.expert_placement import ExpertPlacement


class PlacementRefused(ValueError):
    """The survivors cannot hold every logical expert: serving on them would drop experts."""


@dataclass(frozen=True)
class ShrunkPlacement:
    """`placement` over the `survivors` (old rank ids, survivor i renumbered as rank i), and `loads`:
    `(moe_layer_row, new_rank, local_slot, logical_expert)` of each slot to read from the checkpoint."""

    placement: ExpertPlacement
    survivors: tuple[int, ...]
    loads: tuple[tuple[int, int, int, int], ...]


def shrink_placement(
    placement: ExpertPlacement,
    lost_ranks: set[int] | frozenset[int],
    expert_load: torch.Tensor | None = None,
    max_local_experts: int | None = None,
) -> ShrunkPlacement:
    """The placement of `placement`'s experts on the ranks not in `lost_ranks` (at least one, not all).
    expert_load: `[num_moe_layers, num_logical_experts]` recent load (any real dtype); None: equal.
    max_local_experts: slots a survivor may hold at most; default its current `num_local_experts`.
    Raises ValueError: no rank lost, every rank lost, a rank id out of range, or a load of the wrong shape;
    PlacementRefused: some logical expert cannot be given a replica within the slots allowed."""
    num_ranks = placement.num_ranks
    if not lost_ranks or any(not 0 <= r < num_ranks for r in lost_ranks):
        raise ValueError(f"lost_ranks must name 1..{num_ranks - 1} of ranks 0..{num_ranks - 1}: {lost_ranks}")
    survivors = tuple(r for r in range(num_ranks) if r not in lost_ranks)
    if not survivors:
        raise ValueError("every rank is lost: there is no instance left to re-place experts on")
    num_layers, num_logical = placement.num_moe_layers, placement.num_logical_experts
    if expert_load is None:
        expert_load = torch.ones(num_layers, num_logical)
    if tuple(expert_load.shape) != (num_layers, num_logical):
        raise ValueError(f"expert_load must be [{num_layers}, {num_logical}], got {tuple(expert_load.shape)}")
    slots = placement.num_local_experts
    max_slots = slots if max_local_experts is None else max_local_experts
    load = expert_load.double()
    rows, loads = [], []
    for row in range(num_layers):
        table = [placement.local_logical_experts(row, r) for r in survivors]  # [survivor][slot] -> logical
        new_slots = _slots_needed(table, num_logical, slots, max_slots, row)
        for rank_slots in table:
            rank_slots.extend([-1] * (new_slots - slots))  # -1: an empty slot, to fill below
        orphans = [e for e in range(num_logical) if not any(e in rank_slots for rank_slots in table)]
        for expert in sorted(orphans, key=lambda e: (-float(load[row, e]), e)):
            rank, slot = _slot_for_orphan(table, load[row])
            table[rank][slot] = expert
            loads.append((row, rank, slot, expert))
        for rank, rank_slots in enumerate(table):  # grown slots no orphan took: more copies of the hottest
            for slot, expert in enumerate(rank_slots):
                if expert == -1:
                    rank_slots[slot] = _hottest_per_replica(table, load[row])
                    loads.append((row, rank, slot, rank_slots[slot]))
        rows.append([e for rank_slots in table for e in rank_slots])
    phy2log = torch.tensor(rows, dtype=torch.int64)
    new = ExpertPlacement.from_phy2log(phy2log, num_logical, len(survivors))
    return ShrunkPlacement(new, survivors, tuple(loads))


def _slots_needed(table: list[list[int]], num_logical: int, slots: int, max_slots: int, row: int) -> int:
    """Slots per survivor so that every logical expert fits; raises PlacementRefused past `max_slots`."""
    num_survivors = len(table)
    needed = max(slots, -(-num_logical // num_survivors))
    if needed > max_slots:
        raise PlacementRefused(
            f"MoE layer row {row}: {num_survivors} surviving ranks × {max_slots} expert slots cannot hold "
            f"{num_logical} logical experts (each needs one replica); allow max_local_experts >= {needed} "
            "or restore a rank"
        )
    return needed


def _counts(table: list[list[int]], num_logical: int) -> list[int]:
    counts = [0] * num_logical
    for rank_slots in table:
        for expert in rank_slots:
            if expert >= 0:
                counts[expert] += 1
    return counts


def _rank_load(rank_slots: list[int], load: torch.Tensor, counts: list[int]) -> float:
    return sum(float(load[e]) / counts[e] for e in rank_slots if e >= 0)


def _slot_for_orphan(table: list[list[int]], load: torch.Tensor) -> tuple[int, int]:
    """An empty slot on the least-loaded rank, else the redundant copy whose loss costs least."""
    counts = _counts(table, load.shape[0])
    rank_load = [_rank_load(rank_slots, load, counts) for rank_slots in table]
    empty = [
        (rank_load[r], r, s) for r, rank_slots in enumerate(table) for s, e in enumerate(rank_slots) if e < 0
    ]
    if empty:
        _, rank, slot = min(empty)
        return rank, slot
    # Evicting a copy of e raises e's load per replica from load/c to load/(c-1): the smallest rise wins.
    candidates = [
        (float(load[e]) / (counts[e] - 1) - float(load[e]) / counts[e], rank_load[r], r, s)
        for r, rank_slots in enumerate(table)
        for s, e in enumerate(rank_slots)
        if counts[e] > 1
    ]
    if not candidates:
        raise PlacementRefused("no redundant replica left to give up for an expert that lost its only one")
    _, _, rank, slot = min(candidates)
    return rank, slot


def _hottest_per_replica(table: list[list[int]], load: torch.Tensor) -> int:
    counts = _counts(table, load.shape[0])
    return max(range(load.shape[0]), key=lambda e: (float(load[e]) / counts[e], -e))
