"""The Scheduler shell end to end with a fake model runner: chunking, drafts, stopping, preemption, aborts."""

from __future__ import annotations

import random

import pytest

import pdcluster.engine.scheduler as scheduler_module
from pdcluster.engine.outputs import ModelRunnerOutput
from pdcluster.engine.request import RequestStatus
from tests.engine.conftest import FakeClock, check_packed_rows, fake_runner_output, step


def scheduled_tokens(output):
    return [(item.request_id, item.start_position, item.num_scheduled_tokens) for item in output.scheduled]


def test_chunked_prefill_splits_exact_token_counts(make_scheduler, make_request):
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request(num_prompt_tokens=10, max_tokens=3)
    scheduler.add_request(request)
    history = []
    while scheduler.has_unfinished():
        output, updates = step(scheduler)
        history.append((scheduled_tokens(output), [item.samples for item in output.scheduled], updates))
    assert [h[0] for h in history] == [
        [("r0", 0, 4)],
        [("r0", 4, 4)],
        [("r0", 8, 2)],
        [("r0", 10, 1)],
        [("r0", 11, 1)],
    ]
    assert [h[1] for h in history] == [[False], [False], [True], [True], [True]]
    assert [len(h[2]) for h in history] == [0, 0, 1, 1, 1]
    assert history[-1][2][0].status is RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [7, 7, 7] and request.num_computed_tokens == 12
    scheduler.block_manager.check_no_leaks()


def test_model_inputs_and_slots(make_scheduler, make_request):
    scheduler = make_scheduler(max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", prompt=[1, 2, 3, 4, 5]))
    scheduler.add_request(make_request("b", prompt=[6, 7, 8]))
    output, _ = step(scheduler)
    a, b = output.scheduled
    assert (a.token_ids, a.block_ids, a.slot_mapping(4), a.samples) == (
        [1, 2, 3, 4, 5],
        [0, 1],
        [0, 1, 2, 3, 4],
        True,
    )
    assert (b.token_ids, b.block_ids, b.slot_mapping(4), b.samples) == ([6], [2], [8], False)
    assert output.new_request_ids == ["a", "b"] and output.total_num_scheduled_tokens == 6
    output, _ = step(scheduler)
    assert scheduled_tokens(output) == [("a", 5, 1), ("b", 1, 2)]
    assert output.scheduled[0].token_ids == [7] and output.scheduled[0].slot_mapping(4) == [5]


def test_budget_and_max_num_seqs(make_scheduler, make_request):
    scheduler = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=4))
    output, _ = step(scheduler)
    assert scheduled_tokens(output) == [("r0", 0, 4), ("r1", 0, 4)]
    output, _ = step(scheduler)
    assert scheduled_tokens(output) == [("r0", 4, 1), ("r1", 4, 1)]
    scheduler.abort("r0")
    output, _ = step(scheduler)
    assert scheduled_tokens(output) == [("r1", 5, 1), ("r2", 0, 4)]
    assert output.finished_request_ids == ["r0"]


def test_drafts_verified_rolled_back_and_counted(make_scheduler, make_request):
    scheduler = make_scheduler()
    request = make_request(prompt=[1, 2, 3, 4, 5, 6], max_tokens=20)
    scheduler.add_request(request)
    step(scheduler, next_token=lambda _: 50, drafts=lambda _: [51, 52, 53])
    assert request.spec_token_ids == [51, 52, 53] and request.num_computed_tokens == 6
    output, updates = step(
        scheduler, num_accepted=lambda _, n: 1, next_token=lambda _: 60, drafts=lambda _: [61]
    )
    (item,) = output.scheduled
    assert (item.start_position, item.token_ids, item.spec_token_ids) == (6, [50, 51, 52, 53], [51, 52, 53])
    assert item.slot_mapping(4) == [6, 7, 8, 9] and item.block_ids == [0, 1, 2]
    assert updates[0].new_token_ids == [51, 60]
    assert request.output_token_ids == [50, 51, 60] and request.num_computed_tokens == 8
    assert scheduler.block_manager.block_ids(request) == [0, 1]  # the draft-only block 2 was trimmed
    assert scheduler.block_manager.num_cached_blocks == 2  # tokens 1..6, 50, 51 committed and computed
    assert (request.drafts.num_draft_tokens, request.drafts.num_accepted_tokens) == (3, 1)
    assert request.drafts.num_accepted_tokens_per_position == (1, 0, 0)
    output, _ = step(scheduler)
    assert output.scheduled[0].token_ids == [60, 61]


def test_drafts_are_capped_by_max_tokens_and_budget(make_scheduler, make_request):
    scheduler = make_scheduler(max_num_batched_tokens=3)
    request = make_request(num_prompt_tokens=3, max_tokens=4)
    scheduler.add_request(request)
    step(scheduler, drafts=lambda _: [1, 2, 3, 4, 5])
    assert request.spec_token_ids == [1, 2]  # 1 output so far; at most 4 - 1 - 1 more drafts
    output, _ = step(scheduler, num_accepted=lambda _, n: 0, drafts=lambda _: [8, 9, 10])
    assert output.scheduled[0].spec_token_ids == [1, 2]
    assert request.spec_token_ids == [8]
    request.spec_token_ids = [8, 9, 10]  # more drafts than the budget allows: the tail is dropped
    output, _ = step(scheduler, num_accepted=lambda _, n: n)
    assert output.scheduled[0].spec_token_ids == [8, 9]


@pytest.mark.parametrize(
    "eos, ignore_eos, stop_token_ids, expected_output, expected_status, stop_reason",
    [
        (51, False, (), [50, 51], RequestStatus.FINISHED_STOPPED, None),
        (51, True, (), [50, 51, 52, 60], RequestStatus.FINISHED_LENGTH, None),
        (None, False, (52,), [50, 51, 52], RequestStatus.FINISHED_STOPPED, 52),
        (None, False, (), [50, 51, 52, 60], RequestStatus.FINISHED_LENGTH, None),
    ],
)
def test_stop_conditions_truncate_accepted_tokens(
    make_scheduler,
    make_request,
    eos,
    ignore_eos,
    stop_token_ids,
    expected_output,
    expected_status,
    stop_reason,
):
    scheduler = make_scheduler()
    request = make_request(
        num_prompt_tokens=5,
        max_tokens=4,
        eos_token_id=eos,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
    )
    scheduler.add_request(request)
    step(scheduler, next_token=lambda _: 50, drafts=lambda _: [51, 52])
    _, updates = step(scheduler, next_token=lambda _: 60)
    assert request.output_token_ids == expected_output
    assert updates[0].new_token_ids == expected_output[1:] and updates[0].status is expected_status
    assert request.status is expected_status and request.stop_reason == stop_reason
    assert not scheduler.has_unfinished()
    scheduler.block_manager.check_no_leaks()


def test_preemption_then_resumption_with_prefix_hit(make_scheduler, make_request):
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=16)
    old, new = (
        make_request("old", num_prompt_tokens=8, max_tokens=8),
        make_request("new", num_prompt_tokens=8),
    )
    scheduler.add_request(old)
    scheduler.add_request(new)
    step(scheduler)  # prompts: old in blocks 0, 1; new in 2, 3
    for _ in range(4):
        output, _ = step(scheduler)  # positions 8..11: old in block 4, new in block 5
    assert scheduled_tokens(output) == [("old", 11, 1), ("new", 11, 1)]
    assert scheduler.block_manager.block_ids(new) == [2, 3, 5]
    output, _ = step(scheduler)  # position 12 needs a fourth block each; old takes the last one
    assert output.preempted_request_ids == ["new"] and scheduled_tokens(output) == [("old", 12, 1)]
    assert (new.status, new.num_computed_tokens, new.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert new.output_token_ids == [7] * 5 and scheduler.stats().num_preemptions == 1
    for _ in range(2):
        step(scheduler)
    assert old.status is RequestStatus.FINISHED_LENGTH
    # new resumes from its own cached blocks: 13 tokens, the first 12 (3 full blocks) hit.
    output, _ = step(scheduler)
    assert output.new_request_ids == ["new"] and output.finished_request_ids == ["old"]
    assert scheduled_tokens(output) == [("new", 12, 1)]
    assert output.scheduled[0].block_ids == [2, 3, 5, 6] and output.scheduled[0].token_ids == [7]
    assert new.num_cached_tokens == 0  # the hit count of its first admission
    while scheduler.has_unfinished():
        step(scheduler)
    assert new.output_token_ids == [7] * 16
    scheduler.block_manager.check_no_leaks()


def test_prefix_cache_shared_across_requests(make_scheduler, make_request):
    scheduler = make_scheduler()
    prompt = list(range(20))
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=1))
    step(scheduler)
    scheduler.add_request(b := make_request("b", prompt=prompt + [99], max_tokens=1))
    scheduler.add_request(c := make_request("c", prompt=prompt[:6] + [99], max_tokens=1))
    output, _ = step(scheduler)
    assert scheduled_tokens(output) == [("b", 20, 1), ("c", 4, 3)]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (20, 4)
    assert output.scheduled[0].block_ids[:5] == [0, 1, 2, 3, 4]
    assert scheduler.stats().prefix_cache_hit_rate == 24 / 48


def test_abort_waiting_and_running_frees_blocks(make_scheduler, make_request):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(running := make_request("running", num_prompt_tokens=12))
    scheduler.add_request(make_request("waiting", num_prompt_tokens=12))
    step(scheduler)
    assert running.status is RequestStatus.RUNNING and scheduler.block_manager.num_free_blocks == 62
    assert scheduler.abort("waiting") and scheduler.abort("running") and not scheduler.abort("running")
    assert running.status is RequestStatus.FINISHED_ABORTED and not scheduler.has_unfinished()
    assert scheduler.schedule().finished_request_ids == ["waiting", "running"]
    scheduler.block_manager.check_no_leaks()


def test_abort_between_schedule_and_update_drops_the_tokens(make_scheduler, make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request())
    output = scheduler.schedule()
    scheduler.abort("r0")
    assert scheduler.update_from_output(output, fake_runner_output(output)) == []
    scheduler.block_manager.check_no_leaks()


def test_bad_runner_output_is_an_error(make_scheduler, make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request())
    step(scheduler, drafts=lambda _: [3, 4])
    output = scheduler.schedule()
    with pytest.raises(ValueError, match=r"sampled \[4, 9\] does not fit drafts \[3, 4\]"):
        scheduler.update_from_output(output, ModelRunnerOutput({"r0": [4, 9]}))
    with pytest.raises(ValueError, match=r"sampled \[\] does not fit"):
        scheduler.update_from_output(output, ModelRunnerOutput({}))


def test_a_request_the_runner_failed_finishes_alone_with_an_error(make_scheduler, make_request):
    scheduler = make_scheduler()
    for rid in ("a", "b"):
        scheduler.add_request(make_request(rid, max_tokens=3))
    output = scheduler.schedule()
    runner_output = fake_runner_output(output)
    runner_output.failed["a"] = "sampling failed: ValueError('bad')"
    updates = scheduler.update_from_output(output, runner_output)
    assert [(u.request_id, u.new_token_ids, u.status) for u in updates] == [
        ("a", [], RequestStatus.FINISHED_ERROR),
        ("b", [7], RequestStatus.RUNNING),
    ]
    assert (
        scheduler.get_request("a") is None and output.scheduled[0].request.error == runner_output.failed["a"]
    )
    while scheduler.has_unfinished():
        step(scheduler)
    assert output.scheduled[1].request.output_token_ids == [7, 7, 7]
    scheduler.block_manager.check_no_leaks()


def test_requests_that_cannot_fit_are_rejected_at_add_time(make_scheduler, make_request):
    scheduler = make_scheduler(num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks of 4 tokens, but the whole cache has 4"):
        scheduler.add_request(make_request(num_prompt_tokens=10, max_tokens=8))
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(32\)"):
        scheduler.add_request(make_request(num_prompt_tokens=30, max_tokens=3))
    scheduler.add_request(make_request(num_prompt_tokens=10, max_tokens=7))
    with pytest.raises(ValueError, match="request id 'r0' is already in the scheduler"):
        scheduler.add_request(make_request(num_prompt_tokens=2))


def test_phase_timestamps_follow_the_clock(make_scheduler, make_request):
    clock = FakeClock(10.0)
    scheduler = make_scheduler(clock=clock, max_num_batched_tokens=4)
    request = make_request(num_prompt_tokens=6, max_tokens=3)
    request.arrival_time_s = 9.0
    scheduler.add_request(request)
    while scheduler.has_unfinished():
        clock.advance(1.0)
        step(scheduler)
    assert (request.queue_time_s, request.ttft_s, request.tpot_s) == (2.0, 3.0, 1.0)
    assert request.finished_time_s == 14.0 == request.last_token_time_s


def check_and_write_kv(kv_cache: dict[int, int], output, block_size: int) -> None:
    """A fake KV cache: slot -> hash of the token sequence up to its position. Asserts every position a
    scheduled request attends to (before this step's tokens) holds its own prefix's KV, prefix-cache hits
    included, then writes this step's entries."""
    for item in output.scheduled:
        tokens = item.request.all_token_ids[: item.start_position] + item.token_ids
        slots = [item.block_ids[p // block_size] * block_size + p % block_size for p in range(len(tokens))]
        assert slots[item.start_position :] == item.slot_mapping(block_size)
        for position in range(len(tokens)):
            expected = hash(tuple(tokens[: position + 1]))
            if position < item.start_position:
                assert kv_cache.get(slots[position]) == expected, f"{item.request_id} position {position}"
            else:
                kv_cache[slots[position]] = expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_never_leaks(make_scheduler, make_request, seed):
    """Hundreds of steps over a tight cache: shared prefixes, drafts with random acceptance, stop tokens,
    aborts and preemptions. Every step, invariants hold and every attended KV slot holds the right prefix's
    KV (so prefix hits, trims and evictions never hand out wrong or live blocks); at the end every block is
    free."""
    rng = random.Random(seed)
    kv_cache: dict[int, int] = {}
    scheduler = make_scheduler(num_blocks=24, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=64)
    shared_prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    num_added = num_finished = num_steps = 0
    while num_added < 120 or scheduler.has_unfinished():
        if num_added < 120 and rng.random() < 0.5:
            prompt = rng.choice(shared_prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
            scheduler.add_request(
                make_request(f"q{num_added}", prompt=prompt, max_tokens=rng.randrange(1, 24), eos_token_id=0)
            )
            num_added += 1
        if scheduler.running and rng.random() < 0.05:
            assert scheduler.abort(rng.choice(scheduler.running).request_id)
        output = scheduler.schedule()
        check_packed_rows(output, block_size=4)
        check_and_write_kv(kv_cache, output, block_size=4)
        runner_output = fake_runner_output(
            output,
            next_token=lambda _: rng.randrange(0, 50),
            num_accepted=lambda _, n: rng.randrange(0, n + 1),
            drafts=lambda _: [rng.randrange(1, 50) for _ in range(rng.randrange(0, 4))],
        )
        updates = scheduler.update_from_output(output, runner_output)
        num_finished += sum(update.finished for update in updates)
        assert output.total_num_scheduled_tokens <= 24 and len(scheduler.running) <= 6
        for item in output.scheduled:
            request = item.request
            assert len(item.slot_mapping(4)) == item.num_scheduled_tokens == len(item.token_ids)
            assert request.num_tokens <= request.max_num_tokens
        for request in scheduler.running:  # tables cover exactly the computed tokens (drafts rolled back)
            assert len(scheduler.block_manager.block_ids(request)) == -(-request.num_computed_tokens // 4)
        scheduler.block_manager.check_invariants()
        num_steps += 1
        assert num_steps < 5000, "no progress"
    assert num_steps > 200 and num_finished > 80 and scheduler.stats().num_preemptions > 0
    scheduler.block_manager.check_no_leaks()


def test_remote_prefilled_admissions_wait_for_a_seat(make_scheduler, make_request):
    """Issue 12, finding 1: requests prefilled elsewhere and admitted (`admit_reserved`) beyond
    `max_num_seqs` wait for a seat, holding their blocks, instead of overfilling the running batch (whose
    step then exceeded the input buffers and failed every request); all complete, an aborted one frees its
    blocks."""
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", num_prompt_tokens=6, max_tokens=3) for i in range(5)]
    for request in requests:
        assert scheduler.reserve(request, request.num_prompt_tokens + 1)
    for request in requests:
        assert scheduler.admit_reserved(request.request_id, 5, []) is RequestStatus.RUNNING
    assert scheduler.has_unfinished() and not scheduler.reserved
    assert scheduler.abort("r4")
    finished, num_steps = [], 0
    while scheduler.has_unfinished():
        output, updates = step(scheduler)
        assert len(output.scheduled) <= 2 and len(scheduler.running) <= 2
        finished += [u.request_id for u in updates if u.finished]
        num_steps += 1
        assert num_steps < 50, "no progress"
    assert finished == ["r0", "r1", "r2", "r3"]
    assert [r.output_token_ids for r in requests[:4]] == [[5, 7, 7]] * 4
    assert requests[4].status is RequestStatus.FINISHED_ABORTED
    scheduler.block_manager.check_no_leaks()


@pytest.mark.parametrize("seed,with_drafts", [(0, True), (1, True), (2, False), (3, False)])
def test_decode_fast_path_schedules_as_the_general_plan(
    make_scheduler, make_request, seed, with_drafts, monkeypatch
):
    """`Scheduler._schedule_decode` (every running request decodes one token, no drafts) gives the step the
    general plan gives: two schedulers in lockstep, one with the fast path turned off, schedule the same
    items (positions, counts, block tables) and pack the same inputs from their rows, through block
    crossings, stop tokens, drafts in some steps (whose trims the fast path must see), aborts, arrivals
    and preemptions; the fast path runs in most steps. Without drafts (`with_drafts` False: the runner
    proposes none, as with k = 0) its steps commit through `request_step.commit_decode_step`, and the
    updates equal the general commit's."""
    rng = random.Random(seed)
    fast = make_scheduler(num_blocks=20, max_num_batched_tokens=24, max_num_seqs=5, max_model_len=64)
    slow = make_scheduler(num_blocks=20, max_num_batched_tokens=24, max_num_seqs=5, max_model_len=64)
    slow._schedule_decode = lambda: None
    fast_path, num_fast = fast._schedule_decode, []

    def counted():
        output = fast_path()
        num_fast.append(output is not None)
        return output

    fast._schedule_decode = counted
    num_commits = []
    commit = scheduler_module.commit_decode_step
    counted_commit = lambda *args: num_commits.append(1) or commit(*args)  # noqa: E731
    monkeypatch.setattr(scheduler_module, "commit_decode_step", counted_commit)
    num_added = num_steps = 0
    while num_added < 40 or fast.has_unfinished():
        if num_added < 40 and rng.random() < 0.15:
            prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
            max_tokens = rng.randrange(1, 30)
            for scheduler in (fast, slow):
                scheduler.add_request(make_request(f"q{num_added}", prompt=prompt, max_tokens=max_tokens))
            num_added += 1
        if fast.running and rng.random() < 0.03:
            request_id = rng.choice(fast.running).request_id
            assert fast.abort(request_id) and slow.abort(request_id)
        tokens = {r.request_id: rng.randrange(0, 50) for r in fast.running + fast.waiting}
        drafts = {rid: [rng.randrange(1, 50)] * (rng.random() < 0.05) for rid in tokens}
        outputs = [scheduler.schedule() for scheduler in (fast, slow)]
        got, want = (
            [(i.request_id, i.start_position, i.num_scheduled_tokens, i.block_ids) for i in o.scheduled]
            for o in outputs
        )
        assert got == want
        assert outputs[0].finished_request_ids == outputs[1].finished_request_ids
        check_packed_rows(outputs[0], block_size=4)
        updates = []
        for scheduler, output in zip((fast, slow), outputs, strict=True):
            runner_output = fake_runner_output(
                output, next_token=tokens.__getitem__, drafts=drafts.__getitem__
            )
            if not with_drafts:
                runner_output = ModelRunnerOutput(runner_output.sampled_token_ids)
            updates.append(scheduler.update_from_output(output, runner_output))
            scheduler.block_manager.check_invariants()
        assert updates[0] == updates[1]
        num_steps += 1
        assert num_steps < 3000, "no progress"
    assert fast.stats().num_preemptions == slow.stats().num_preemptions
    assert sum(num_fast) > num_steps // 3
    assert (len(num_commits) > num_steps // 3) if not with_drafts else not num_commits
    fast.block_manager.check_no_leaks()
