"""`schedule_step` as a pure function: budget, ordering, chunking, admission limits and preemption."""

from __future__ import annotations

import pytest

from pdcluster.engine.scheduler_policy import RequestView, SchedulerConfig, check_request_fits, schedule_step

CONFIG = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, max_model_len=64)


def decode(request_id, arrival_index, num_computed_tokens=8, num_spec_tokens=0, held=None, exclusive=None):
    """A running request between decode steps: its last sampled token (plus drafts) to compute."""
    held = -(-num_computed_tokens // 4) if held is None else held
    return RequestView(
        request_id,
        arrival_index,
        num_computed_tokens,
        1 + num_spec_tokens,
        is_prefill=False,
        num_blocks_held=held,
        num_blocks_exclusive=held if exclusive is None else exclusive,
    )


def prefill(request_id, arrival_index, num_tokens, num_computed_tokens=0, held=None):
    held = -(-num_computed_tokens // 4) if held is None else held
    return RequestView(
        request_id, arrival_index, num_computed_tokens, num_tokens - num_computed_tokens, True, held, held
    )


def waiting(request_id, arrival_index, num_tokens, num_cached_tokens=0, num_evictable=0):
    return RequestView(
        request_id,
        arrival_index,
        0,
        num_tokens,
        num_cached_tokens=num_cached_tokens,
        num_cached_blocks_evictable=num_evictable,
    )


def test_decodes_before_prefill_chunks_then_admissions():
    running = [prefill("p", 0, num_tokens=40, num_computed_tokens=8), decode("d1", 1), decode("d2", 2, 8, 2)]
    plan = schedule_step(CONFIG, running, [waiting("w", 3, 10)], num_free_blocks=20)
    assert list(plan.num_scheduled_tokens.items()) == [("d1", 1), ("d2", 3), ("p", 12)]
    assert plan.num_new_blocks == {"d1": 1, "d2": 1, "p": 3}  # p: 8 + 12 tokens -> 5 blocks, holds 2
    assert plan.total_num_scheduled_tokens == 16 and plan.admitted == {}
    assert plan.preempted_request_ids == () and plan.num_free_blocks_left == 15


def test_waiting_prompt_is_chunked_to_the_budget():
    plan = schedule_step(CONFIG, [decode("d", 0)], [waiting("w", 1, 30), waiting("x", 2, 4)], 20)
    assert plan.num_scheduled_tokens == {"d": 1, "w": 15}
    assert plan.admitted == {"w": 0} and plan.num_new_blocks["w"] == 4


def test_without_chunking_a_prompt_must_fit_whole_and_blocks_later_ones():
    config = SchedulerConfig(16, 4, 4, max_model_len=16, enable_chunked_prefill=False)
    plan = schedule_step(config, [decode("d", 0)], [waiting("w", 1, 16), waiting("x", 2, 2)], 20)
    assert plan.num_scheduled_tokens == {"d": 1} and plan.admitted == {}
    plan = schedule_step(config, [], [waiting("w", 1, 16), waiting("x", 2, 2)], 20)
    assert plan.num_scheduled_tokens == {"w": 16}


def test_long_prefill_threshold_caps_each_chunk():
    config = SchedulerConfig(16, 4, 4, 64, long_prefill_token_threshold=6)
    plan = schedule_step(config, [prefill("p", 0, 20, 4)], [waiting("w", 1, 20), waiting("x", 2, 3)], 20)
    assert plan.num_scheduled_tokens == {"p": 6, "w": 6, "x": 3}


def test_max_num_seqs_and_fcfs_order():
    waiting_views = [waiting("late", 9, 2), waiting("early", 5, 2), waiting("mid", 7, 2)]
    plan = schedule_step(CONFIG, [decode("a", 0), decode("b", 1)], waiting_views, 20)
    assert list(plan.admitted) == ["early", "mid"]


def test_prefix_hit_costs_no_budget_but_evictable_blocks_count():
    view = waiting("w", 0, num_tokens=10, num_cached_tokens=8, num_evictable=2)
    assert schedule_step(CONFIG, [], [view], num_free_blocks=2).admitted == {}
    plan = schedule_step(CONFIG, [], [view], num_free_blocks=3)
    assert plan.admitted == {"w": 8} and plan.num_scheduled_tokens == {"w": 2}
    assert plan.num_new_blocks == {"w": 1} and plan.num_free_blocks_left == 0


def test_preempts_the_latest_arrival_and_admits_nobody():
    running = [decode("old", 0, num_computed_tokens=8), decode("new", 1, num_computed_tokens=6)]
    plan = schedule_step(CONFIG, running, [waiting("w", 2, 2)], num_free_blocks=0)
    assert plan.preempted_request_ids == ("new",)
    assert plan.num_scheduled_tokens == {"old": 1} and plan.admitted == {}
    assert plan.num_free_blocks_left == 1  # new's 2 blocks back, old's third block out


def test_latest_request_preempts_itself():
    running = [decode("old", 0, num_computed_tokens=6), decode("new", 1, num_computed_tokens=8)]
    plan = schedule_step(CONFIG, running, [], num_free_blocks=0)
    assert plan.preempted_request_ids == ("new",) and plan.num_scheduled_tokens == {"old": 1}


def test_preempting_an_already_scheduled_request_refunds_it():
    # The decode (latest arrival) is scheduled first, then the older prefill needs its block.
    running = [prefill("p", 0, num_tokens=12, num_computed_tokens=4), decode("d", 1, num_computed_tokens=7)]
    plan = schedule_step(CONFIG, running, [], num_free_blocks=1)
    assert plan.preempted_request_ids == ("d",)
    assert plan.num_scheduled_tokens == {"p": 8} and plan.num_new_blocks == {"p": 2}
    assert plan.num_free_blocks_left == 1


def test_shared_blocks_are_not_counted_as_freed():
    running = [decode("a", 0), decode("b", 1, held=2, exclusive=0), decode("c", 2, held=2, exclusive=1)]
    plan = schedule_step(CONFIG, running, [], num_free_blocks=0)
    # a needs 1 block: c frees 1 (its other block is shared); b and c each need one more, b preempts itself.
    assert plan.preempted_request_ids == ("c", "b") and plan.num_scheduled_tokens == {"a": 1}


def test_check_request_fits():
    check_request_fits(CONFIG, num_blocks=4, num_prompt_tokens=10, max_tokens=7)  # 16 slots = 4 blocks
    with pytest.raises(ValueError, match=r"needs 5 KV blocks of 4 tokens, but the whole cache has 4"):
        check_request_fits(CONFIG, num_blocks=4, num_prompt_tokens=10, max_tokens=8)
    with pytest.raises(ValueError, match=r"= 65 exceeds max_model_len \(64\)"):
        check_request_fits(CONFIG, num_blocks=100, num_prompt_tokens=60, max_tokens=5)
    with pytest.raises(ValueError, match="at least 1 token"):
        check_request_fits(CONFIG, num_blocks=100, num_prompt_tokens=0, max_tokens=5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an int >= 1, got 0"),
        (dict(max_num_seqs=0), "max_num_seqs must be an int >= 1, got 0"),
        (dict(block_size=0), "block_size must be an int >= 1, got 0"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be >= 0, got -1"),
        (
            dict(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=16),
            r"max_num_batched_tokens \(8\) must be >= max_model_len \(16\) when enable_chunked_prefill",
        ),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)
