"""Adaptive speculation policy: exact choices of k on constructed acceptance counters."""

from __future__ import annotations

import pytest

from engine.spec_policy import choose_num_speculative_tokens, decay_counts


@pytest.mark.parametrize(
    ("accepted", "drafted", "max_k", "min_accept_prob", "expected"),
    [
        # High acceptance at every depth: r = [0.9, 0.8, 0.7] >= 0.5 -> grows to max_k.
        ([9, 8, 7], [10, 10, 10], 3, 0.5, 3),
        # Low acceptance: r_1 = 0.1 < 0.5 -> shrinks to the floor of 1 (never 0).
        ([1, 0, 0], [10, 10, 10], 3, 0.5, 1),
        # In between: r = [0.8, 0.5, 0.2]; depth 2 at exactly the threshold still pays.
        ([8, 5, 2], [10, 10, 10], 3, 0.5, 2),
        ([8, 5, 2], [10, 10, 10], 3, 0.2, 3),
        ([8, 5, 2], [10, 10, 10], 3, 0.81, 1),
        # The choice never exceeds max_k, whatever the counters hold.
        ([9, 8, 7], [10, 10, 10], 2, 0.5, 2),
        # No counts yet: optimistic start at max_k.
        ([], [], 4, 0.5, 4),
        # Only depth 1 measured (k was 1): a_1 = 0.9 extrapolates r = [0.9, 0.81, 0.729] -> grow to 3.
        ([9, 0, 0], [10, 0, 0], 3, 0.5, 3),
        # a_1 = 0.6: extrapolated r_2 = 0.36 < 0.5 -> stay at 1.
        ([6], [10], 3, 0.5, 1),
        # Conditional rate of the deepest measured depth: a_2 = 0.5 / 0.8, r_3 = 0.5 * 0.625 = 0.3125.
        ([8, 5], [10, 10], 3, 0.3, 3),
        ([8, 5], [10, 10], 3, 0.32, 2),
        # A decayed-away (stale) depth counts as unmeasured, even with a bad old ratio: re-explored.
        ([9, 0.0], [10, 0.5], 2, 0.5, 2),
        # A deeper depth is never likelier than a shallower one: r_2 = min(0.5, 5/5) = 0.5.
        ([5, 5], [10, 5], 2, 0.5, 2),
        ([5, 5], [10, 5], 2, 0.51, 1),
    ],
)
def test_choose_num_speculative_tokens_exact(accepted, drafted, max_k, min_accept_prob, expected):
    assert choose_num_speculative_tokens(accepted, drafted, max_k, min_accept_prob) == expected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1], [1], 0, 0.5), "max_k"),
        (([1], [1], 2, 0.0), "min_accept_prob"),
        (([1], [1], 2, 1.5), "min_accept_prob"),
        (([1, 1], [1], 2, 0.5), "accepted counts"),
    ],
)
def test_choose_num_speculative_tokens_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        choose_num_speculative_tokens(*args)


def test_decay_counts():
    assert decay_counts([10.0, 4.0], [3, 2, 1], 0.5) == [8.0, 4.0, 1.0]
    assert decay_counts([10.0, 4.0], [], 0.5) == [5.0, 2.0]
    assert decay_counts([], [1, 1], 0.9) == [1.0, 1.0]
    with pytest.raises(ValueError, match="decay"):
        decay_counts([1.0], [1], 1.5)
