"""Adaptive speculation: how many MTP drafts k to propose next step, from recent acceptance counts."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_DECAY = 0.9
"""Per-step weight of older counts: a step's verification results count half after ~6.6 steps."""


def decay_counts(counts: Sequence[float], new_counts: Sequence[float], decay: float) -> list[float]:
    """`decay * counts + new_counts`, element-wise; the shorter list is padded with zeros.

    counts: `[num_positions]` decayed counts so far (per draft depth).
    new_counts: `[num_positions']` this step's counts.
    """
    if not 0 <= decay <= 1:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    n = max(len(counts), len(new_counts))
    old = list(counts) + [0.0] * (n - len(counts))
    new = list(new_counts) + [0.0] * (n - len(new_counts))
    return [decay * o + x for o, x in zip(old, new, strict=True)]


def choose_num_speculative_tokens(
    accepted_per_position: Sequence[float],
    drafted_per_position: Sequence[float],
    max_k: int,
    min_accept_prob: float,
    min_num_drafts: float = 1.0,
) -> int:
    """The number of drafts k in [1, max_k] that maximizes expected committed tokens minus the cost of
    verifying the drafts (see the module docstring for the rule).

    accepted_per_position: `[num_positions]` (decayed) drafts accepted at depth i+1; a draft counts
    as accepted only when every shallower draft of its step was accepted too.
    drafted_per_position: `[num_positions]` (decayed) drafts proposed at depth i+1.
    Raises ValueError: `max_k < 1`, `min_accept_prob` outside (0, 1], or lists of different lengths."""
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    if not 0 < min_accept_prob <= 1:
        raise ValueError(f"min_accept_prob must be in (0, 1], got {min_accept_prob}")
    if len(accepted_per_position) != len(drafted_per_position):
        raise ValueError(
            f"{len(accepted_per_position)} accepted counts for {len(drafted_per_position)} drafted counts"
        )
    k = 0
    reach = 1.0
    conditional = 1.0
    measuring = True
    for depth in range(max_k):
        drafted = drafted_per_position[depth] if depth < len(drafted_per_position) else 0.0
        measuring = measuring and drafted >= min_num_drafts
        if measuring:
            # min(): noise (or budget-capped deeper drafts) must not make a deeper depth likelier.
            r = min(reach, accepted_per_position[depth] / drafted)
            conditional = r / reach if reach > 0 else 0.0
        else:
            r = reach * conditional
        if r < min_accept_prob:
            break
        k, reach = depth + 1, r
    return max(1, k)
