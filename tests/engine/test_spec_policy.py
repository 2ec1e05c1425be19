"""Adaptive speculation: exact choices of k on constructed counters, and the engine with it on."""

from __future__ import annotations

import pytest

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.spec_policy import choose_num_speculative_tokens, decay_counts
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts


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


def test_adaptive_speculation_keeps_greedy_output_and_changes_k():
    """On the bundled model (acceptance by depth ~[0.69, 0.33, 0.23] at k=3): with threshold 0.5 the
    engine starts at k=3, shrinks once it has measured acceptance, and greedy tokens equal k=0's."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = heldout_def_prompts(16)
    plain = LLM(bundled_checkpoint_dir(), num_kv_blocks=512, block_size=16)
    reference = [o.token_ids for o in plain.generate(prompts, greedy)]
    adaptive = plain.replace_config(
        num_speculative_tokens=3, adaptive_speculation=True, adaptive_speculation_min_accept_prob=0.5
    )
    outputs = adaptive.generate(prompts, greedy)
    assert [o.token_ids for o in outputs] == reference
    steps_per_k = adaptive.engine.executor.num_steps_per_k
    assert steps_per_k.get(3, 0) >= 1 and steps_per_k.get(1, 0) >= 1, steps_per_k
    assert set(steps_per_k) <= {1, 2, 3}
    # Fewer deep drafts than fixed k=3 proposes.
    fixed = plain.replace_config(num_speculative_tokens=3).generate(prompts, greedy)
    assert sum(o.drafts.num_draft_tokens for o in outputs) < sum(o.drafts.num_draft_tokens for o in fixed)


def test_adaptive_speculation_with_async_scheduling_is_rejected():
    with pytest.raises(ValueError, match="adaptive_speculation.*async_scheduling"):
        EngineConfig(model="m", num_speculative_tokens=2, adaptive_speculation=True, async_scheduling=True)
    with pytest.raises(ValueError, match="adaptive_speculation_min_accept_prob"):
        EngineConfig(model="m", adaptive_speculation_min_accept_prob=0.0)
