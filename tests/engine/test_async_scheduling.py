"""Asynchronous scheduling (pdcluster/engine/async_loop.py): step N+1 is scheduled before step N's tokens
are known.

Scheduler-level tests drive the real `Scheduler` in the pipelined order (schedule N+1, then commit N) with a
fake runner whose token at each position is a fixed function of (request, position): the pipelined loop
must commit exactly what the synchronous loop commits, fill every placeholder with the token the previous
step sampled, and leak nothing through finishes, aborts and preemptions. Engine-level tests run the tiny
checkpoint and prove the same for real forwards on a worker thread.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.model_runner import InputBuffers, build_model_input
from pdcluster.engine.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from pdcluster.engine.request import RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.scheduler_policy import SchedulerConfig
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts
from tests.engine.conftest import FakeClock, check_packed_rows

EOS = 100


def true_token(request_id: str, position: int) -> int:
    """The fake model's token at `position` (>= the prompt length) of a request: 100..149, 100 is EOS."""
    return 100 + (sum(map(ord, request_id)) * 31 + position * 7 + position * position) % 50


class FakeExecutor:
    """Mimics `Executor.run` over a fake model whose token at every position is fixed (`true_token`).

    Resolves placeholders from its previous step's results (bonus token, drafts, and the shift back by the
    drafts that step rejected), checks every known input against the true sequence and that the block
    table covers every position, accepts the drafts equal to the true tokens, samples the true token after
    them, and proposes `num_speculative_tokens` drafts (every third one wrong).
    """

    def __init__(
        self, prompts: dict[str, list[int]], block_size: int, num_speculative_tokens: int = 0
    ) -> None:
        self.prompts = prompts
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.last: dict[str, tuple[list[int], list[int], int]] = {}  # tokens, drafts, num_rejected
        self.num_placeholder_steps = 0
        self.num_shifted_steps = 0

    def truth(self, request_id: str, position: int) -> int:
        prompt = self.prompts[request_id]
        return prompt[position] if position < len(prompt) else true_token(request_id, position)

    def run(self, output: SchedulerOutput) -> ModelRunnerOutput:
        check_packed_rows(output, self.block_size)  # called right after schedule(), as the executor is
        sampled, spec, last = {}, {}, {}
        for item in output.scheduled:
            rid, start = item.request_id, item.start_position
            inputs, drafts = list(item.token_ids), list(item.spec_token_ids)
            if PLACEHOLDER_TOKEN_ID in inputs:
                tokens, proposed, num_rejected = self.last[rid]
                inputs = ([tokens[-1]] + proposed)[: item.num_scheduled_tokens]
                inputs += [tokens[-1]] * (item.num_scheduled_tokens - len(inputs))
                drafts, start = inputs[1:], start - num_rejected
                self.num_placeholder_steps += 1
                self.num_shifted_steps += num_rejected > 0
            assert start + len(inputs) <= len(item.block_ids) * self.block_size, f"{rid}: no KV slots"
            num_known = len(inputs) - len(drafts)
            for offset in range(num_known):
                expected = self.truth(rid, start + offset)
                assert inputs[offset] == expected, f"{rid} position {start + offset}: {inputs[offset]}"
            if not item.samples:
                continue
            bonus_position = start + num_known
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == self.truth(
                rid, bonus_position + num_accepted
            ):
                num_accepted += 1
            newest = bonus_position + num_accepted
            tokens = drafts[:num_accepted] + [self.truth(rid, newest)]
            proposed = [
                self.truth(rid, newest + 1 + d) if (newest + d) % 3 else 99  # 99: never the true token
                for d in range(self.num_speculative_tokens)
            ]
            sampled[rid], spec[rid] = tokens, proposed
            last[rid] = (tokens, proposed, len(drafts) - num_accepted)
        self.last = last
        return ModelRunnerOutput(sampled, spec)


def make_pipelined_scheduler(
    num_blocks: int, num_speculative_tokens: int, pipelined: bool, max_num_batched_tokens: int = 16
) -> Scheduler:
    config = SchedulerConfig(
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=6,
        max_model_len=256,
        num_lookahead_tokens=max(0, num_speculative_tokens - 1),
    )
    num_draft_placeholders = num_speculative_tokens if pipelined else 0
    return Scheduler(config, num_blocks, True, FakeClock(), num_draft_placeholders=num_draft_placeholders)


def add_workload(scheduler: Scheduler, make_request, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    prompts = {}
    for i in range(24):
        rid = f"r{i}"
        prompts[rid] = [rng.randrange(1, 90) for _ in range(rng.randint(1, 30))]
        scheduler.add_request(
            make_request(
                rid,
                prompt=prompts[rid],
                max_tokens=rng.randint(1, 20),
                eos_token_id=EOS,
                stop_token_ids=(149,) if i % 3 == 0 else (),
            )
        )
    return prompts


def run_sync(scheduler: Scheduler, fake: FakeExecutor) -> None:
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        scheduler.update_from_output(output, fake.run(output))


def run_pipelined(scheduler: Scheduler, fake: FakeExecutor, abort=lambda step: []) -> list[SchedulerOutput]:
    """The async loop's order: schedule + run step N+1, then commit step N; `abort(step)` lists requests
    to abort between steps (while a step is in flight)."""
    outputs, in_flight, num_steps = [], None, 0
    while scheduler.has_unfinished() or in_flight is not None:
        num_max = 1 + scheduler.num_draft_placeholders
        assert all(r.num_output_placeholders <= num_max for r in scheduler.running)  # only step N's
        output = scheduler.schedule()
        runner_output = fake.run(output)  # the worker runs it after the step in flight, in order
        previous, in_flight = in_flight, (output, runner_output)
        outputs.append(output)
        if previous is not None:
            scheduler.update_from_output(*previous)
        if not scheduler.has_unfinished() and in_flight is not None:
            scheduler.update_from_output(*in_flight)  # drain: every result in it is discarded
            in_flight = None
        num_steps += 1
        for rid in abort(num_steps):
            scheduler.abort(rid)
    return outputs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: preemptions
@pytest.mark.parametrize("k", [0, 2], ids=lambda k: f"k={k}")
def test_pipelined_scheduler_commits_what_sync_commits(make_request, seed, num_blocks, k):
    results = {}
    for pipelined in (False, True):
        scheduler = make_pipelined_scheduler(num_blocks, k, pipelined)
        prompts = add_workload(scheduler, make_request, seed)
        requests = dict(scheduler.requests)
        fake = FakeExecutor(prompts, block_size=4, num_speculative_tokens=k)
        if pipelined:
            run_pipelined(scheduler, fake)
            assert fake.num_placeholder_steps > 0
            assert (fake.num_shifted_steps > 0) == (k > 0)
        else:
            run_sync(scheduler, fake)
            assert fake.num_placeholder_steps == 0
        scheduler.block_manager.check_no_leaks()
        assert all(r.num_output_placeholders == 0 for r in requests.values())
        results[pipelined] = {rid: (r.output_token_ids, r.status) for rid, r in requests.items()}
        if num_blocks == 14:
            assert scheduler.num_preemptions > 0
        if k:
            assert sum(r.drafts.num_accepted_tokens for r in requests.values()) > 0
    assert results[True] == results[False]
    statuses = {status for _, status in results[False].values()}
    assert statuses == {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH}


def test_placeholder_is_scheduled_before_the_token_is_committed(make_scheduler, make_request):
    scheduler = make_scheduler()
    request = make_request(prompt=[1, 2, 3], max_tokens=3)
    scheduler.add_request(request)
    step_0 = scheduler.schedule()
    step_1 = scheduler.schedule()  # step 0 still in flight
    (item,) = step_1.scheduled
    assert (item.start_position, item.token_ids, item.samples) == (3, [PLACEHOLDER_TOKEN_ID], True)
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 4
    scheduler.update_from_output(step_0, ModelRunnerOutput({"r0": [7]}))
    assert request.output_token_ids == [7] and request.num_output_placeholders == 1
    step_2 = scheduler.schedule()  # samples the third (last allowed) token
    assert [i.start_position for i in step_2.scheduled] == [4]
    scheduler.update_from_output(step_1, ModelRunnerOutput({"r0": [8]}))
    # Step 2 (in flight) samples the max_tokens-th token: nothing more is scheduled.
    assert scheduler.schedule().scheduled == []
    scheduler.update_from_output(step_2, ModelRunnerOutput({"r0": [9]}))
    assert request.output_token_ids == [7, 8, 9] and request.status is RequestStatus.FINISHED_LENGTH
    scheduler.block_manager.check_no_leaks()


@pytest.mark.parametrize("k", [0, 2], ids=lambda k: f"k={k}")
def test_decode_left_out_of_a_step_for_lack_of_budget(make_request, k):
    """Budget 3 = one decode with k = 2: while A's step is in flight, B (whose step is also in flight)
    gets no token in the next step, nor in the following ones while A decodes. Committing B's step leaves
    it with no step in flight, so once A stops (a stop token: no shorter last steps that would leave B
    a token or two), B's next step runs known tokens: the drafts its committed step proposed."""
    results = {}
    for pipelined in (False, True):
        scheduler = make_pipelined_scheduler(64, k, pipelined, max_num_batched_tokens=3)
        prompts = {"a": [1], "b": [2]}
        stop = (true_token("a", 4),)
        scheduler.add_request(make_request("a", prompt=prompts["a"], max_tokens=12, stop_token_ids=stop))
        scheduler.add_request(make_request("b", prompt=prompts["b"], max_tokens=12))
        requests = dict(scheduler.requests)
        fake = FakeExecutor(prompts, block_size=4, num_speculative_tokens=k)
        if pipelined:
            outputs = run_pipelined(scheduler, fake)
            left_out = [i.request_id for i in outputs[1].scheduled] == ["a"]  # b's step still in flight
            assert left_out == (k > 0)
        else:
            run_sync(scheduler, fake)
        scheduler.block_manager.check_no_leaks()
        results[pipelined] = {rid: (r.output_token_ids, r.status) for rid, r in requests.items()}
        assert all(r.num_output_placeholders == 0 for r in requests.values())
    assert results[True] == results[False]
    assert results[True]["a"][1] is RequestStatus.FINISHED_STOPPED


def test_draft_placeholders_are_placed_optimistically_and_rolled_back(make_request):
    """k = 2: the step after an in-flight one is placed as if all its drafts were accepted; committing the
    in-flight step rolls `num_computed_tokens` back by its rejected drafts (the executor moves the step's
    positions back by as many)."""
    scheduler = make_pipelined_scheduler(64, num_speculative_tokens=2, pipelined=True)
    request = make_request(prompt=[1, 2, 3], max_tokens=10)
    scheduler.add_request(request)
    step_0 = scheduler.schedule()  # prompt; samples token 1 and proposes 2 drafts
    assert request.spec_token_ids == [PLACEHOLDER_TOKEN_ID] * 2
    step_1 = scheduler.schedule()  # bonus + 2 drafts, at position 3
    (item,) = step_1.scheduled
    assert (item.start_position, item.token_ids, item.samples) == (3, [PLACEHOLDER_TOKEN_ID] * 3, True)
    assert request.num_output_placeholders == 1 + 3 and request.num_computed_tokens == 6
    scheduler.update_from_output(step_0, ModelRunnerOutput({"r0": [7]}))
    assert request.output_token_ids == [7] and request.num_output_placeholders == 3
    step_2 = scheduler.schedule()  # as if step 1 accepted both drafts: bonus at position 6
    assert [(i.start_position, i.num_scheduled_tokens) for i in step_2.scheduled] == [(6, 3)]
    scheduler.update_from_output(step_1, ModelRunnerOutput({"r0": [8, 9]}))  # 1 of 2 drafts accepted
    assert request.output_token_ids == [7, 8, 9] and request.drafts.num_accepted_tokens == 1
    # Step 2 really runs positions 5..7 (moved back by 1): its KV ends where num_computed_tokens says.
    assert request.num_computed_tokens == 8 and request.num_output_placeholders == 3
    assert request.drafts.num_draft_tokens_per_position == (1, 1)
    scheduler.update_from_output(step_2, ModelRunnerOutput({"r0": [10]}))  # both drafts rejected
    # As between synchronous steps: the newest token (10, position 6) has no KV yet.
    assert request.num_computed_tokens == 6 == request.num_tokens - 1
    assert request.num_output_placeholders == 0


def test_request_finished_in_step_n_is_dropped_from_step_n_plus_1(make_scheduler, make_request):
    scheduler = make_scheduler()
    request = make_request(prompt=[1, 2, 3], max_tokens=10, eos_token_id=EOS)
    scheduler.add_request(request)
    step_0 = scheduler.schedule()
    step_1 = scheduler.schedule()
    scheduler.update_from_output(step_0, ModelRunnerOutput({"r0": [EOS]}))  # finishes; step 1 holds it
    assert request.status is RequestStatus.FINISHED_STOPPED
    scheduler.block_manager.check_no_leaks()  # blocks freed while step 1 is in flight
    assert scheduler.update_from_output(step_1, ModelRunnerOutput({"r0": [5]})) == []
    assert request.output_token_ids == [EOS]
    assert scheduler.schedule().finished_request_ids == ["r0"]  # the executor drops its state after step 1


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [0, 2], ids=lambda k: f"k={k}")
def test_aborts_and_preemptions_while_a_step_is_in_flight_leak_nothing(make_request, seed, k):
    scheduler = make_pipelined_scheduler(14, k, pipelined=True)
    prompts = add_workload(scheduler, make_request, seed)
    requests = dict(scheduler.requests)
    rng = random.Random(seed)

    def abort(step: int) -> list[str]:
        alive = sorted(scheduler.requests)
        return rng.sample(alive, 1) if alive and rng.random() < 0.2 else []

    run_pipelined(scheduler, FakeExecutor(prompts, block_size=4, num_speculative_tokens=k), abort)
    scheduler.block_manager.check_no_leaks()
    assert scheduler.num_preemptions > 0
    assert any(r.status is RequestStatus.FINISHED_ABORTED for r in requests.values())
    for rid, request in requests.items():  # each token still comes from the right position
        expected = [true_token(rid, len(prompts[rid]) + i) for i in range(request.num_output_tokens)]
        assert request.output_token_ids == expected


# ---- input buffers -------------------------------------------------------------------------------------


def test_input_buffers_pack_in_place_and_match_a_fresh_pack():
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, max_num_blocks_per_req=4, block_size=4)
    args = ([[5, 6, 7], [8], [9, 10]], [0, 6, 3], [[3], [1, 2], [0, 7]])
    first = buffers.pack(*args)
    expected = build_model_input(*args, block_size=4)
    for got, want in zip(first, expected, strict=True):
        assert torch.equal(got, want)
    assert first.slot_mapping.tolist() == [12, 13, 14, 10, 3, 28]
    assert first.block_tables.tolist() == [[3, 0], [1, 2], [0, 7]]
    second = buffers.pack([[1, 2]], [4], [[6, 4]], slot_mapping=[16, 17])
    assert second.input_ids.data_ptr() == first.input_ids.data_ptr()  # same memory, refilled
    assert (second.positions.tolist(), second.slot_mapping.tolist()) == ([4, 5], [16, 17])
    assert second.block_tables.tolist() == [[6, 4]] and second.query_start_loc.tolist() == [0, 2]
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        buffers.pack([[1] * 17], [0], [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="table has 1"):
        buffers.pack([[1] * 5], [0], [[0]])


def test_placeholders_resolved_for_the_whole_batch_as_request_by_request():
    """`Executor._resolve_placeholders` patches the packed batch with whole-batch ops exactly as resolving
    each placeholder request alone does: a known-token request left as is, one with no rejected draft,
    one whose previous step rejected 2 of 3 drafts (moved back: positions, slots, sequence length) and
    one given fewer drafts than its slots (filler drafts)."""
    from types import SimpleNamespace

    from pdcluster.engine.executor import Executor, PreparedStep, StepResult
    from pdcluster.engine.outputs import ScheduledRequest
    from pdcluster.engine.request import Request

    bs, P = 4, PLACEHOLDER_TOKEN_ID
    requests = [Request(f"r{i}", [1, 2, 3], GREEDY, arrival_time_s=0.0) for i in range(4)]
    items = [
        ScheduledRequest(requests[0], 5, 1, [], [0, 1], True),
        ScheduledRequest(requests[1], 3, 1, [], [2], True, num_placeholders=1),
        ScheduledRequest(requests[2], 9, 4, [P, P, P], [3, 4, 5, 6], True, num_placeholders=1),
        ScheduledRequest(requests[3], 6, 3, [P, P], [7, 8, 9], True, num_placeholders=1),
    ]
    last_step = {
        "r1": StepResult([40], [], 0),
        "r2": StepResult([50, 51], [52, 53, 54], 2),
        "r3": StepResult([60], [61], 0),
    }
    inputs = [[9], [P], [P] * 4, [P] * 3]
    starts = [item.start_position for item in items]
    tables = [item.block_ids for item in items]
    executor = Executor.__new__(Executor)  # only the placeholder state: no model needed
    executor.runner, executor._last_step = SimpleNamespace(block_size=bs), last_step
    batch = build_model_input(inputs, starts, tables, bs)
    prepared = PreparedStep(batch, batch.query_start_loc.tolist(), [1, 2, 3])
    resolved = executor._resolve_placeholders(items, prepared)

    want_inputs = [[9], [40], [51, 52, 53, 54], [60, 61, 60]]
    want_starts = [5, 3, 7, 6]  # r2 moved back by its 2 rejected drafts
    want = build_model_input(want_inputs, want_starts, tables, bs)
    for name, expected, got in zip(want._fields, want, batch, strict=True):
        assert got.tolist() == expected.tolist(), name
    assert [item.start_position for item in resolved] == want_starts
    assert [item.spec_token_ids for item in resolved] == [[], [], [52, 53, 54], [61, 60]]
    assert items[2].start_position == 9  # the scheduler's items are left as they were
    executor._last_step = {}
    with pytest.raises(RuntimeError, match="placeholders of 'r1', but the last step sampled nothing"):
        executor._resolve_placeholders(items, prepared)


# ---- engine end to end (tiny checkpoint) ---------------------------------------------------------------

CKPT = bundled_checkpoint_dir()
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(CKPT, num_kv_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_def_prompts(8)


@pytest.fixture(scope="module")
def reference(llm, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def assert_nothing_left(llm: LLM) -> None:
    engine = llm.engine
    engine.scheduler.block_manager.check_no_leaks()
    assert engine.executor.num_tracked_requests == 0
    assert not engine._async_loop.has_step_in_flight


def test_forward_of_step_n_overlaps_scheduling_of_step_n_plus_1(llm, prompts, reference):
    """Each step's forward on the worker waits (up to 30 s) until the main thread has scheduled the
    following step. A synchronous loop could never get there; the pipeline always does (except for the
    step still in flight when the last request finishes: the drain waits for it)."""
    other = llm.replace_config(async_scheduling=True)
    engine, loop = other.engine, other.engine._async_loop
    changed = threading.Condition()
    schedule_index: dict[int, int] = {}  # id(SchedulerOutput) -> its schedule() call number
    num_scheduled, draining, overlapped, running = [0], [False], [], [None]
    schedule, run, drain = engine.scheduler.schedule, engine.executor.run, loop.drain
    forward = engine.runner.forward

    def counting_schedule():
        output = schedule()
        with changed:
            schedule_index[id(output)] = num_scheduled[0]
            num_scheduled[0] += 1
            changed.notify_all()
        return output

    def recording_run(output, prepared, on_layer_kv=None, **kwargs):
        running[0] = output
        return run(output, prepared, on_layer_kv, **kwargs)

    def waiting_forward(*args, **kwargs):
        output = running[0]
        if (
            output is not None
            and output.scheduled
            and threading.current_thread() is not threading.main_thread()
        ):
            with changed:
                next_index = schedule_index[id(output)] + 1
                changed.wait_for(lambda: num_scheduled[0] > next_index or draining[0], timeout=30)
                overlapped.append(num_scheduled[0] > next_index)
        return forward(*args, **kwargs)

    def flagged_drain():
        with changed:
            draining[0] = True
            changed.notify_all()
        drain()

    engine.scheduler.schedule, engine.executor.run, loop.drain = (
        counting_schedule,
        recording_run,
        flagged_drain,
    )
    engine.runner.forward = waiting_forward
    outputs = other.generate(prompts[:4], GREEDY)
    assert [o.token_ids for o in outputs] == reference[:4]
    assert len(overlapped) > 4 and sum(overlapped) >= len(overlapped) - 1


@pytest.mark.parametrize("k", [0, 2], ids=lambda k: f"k={k}")
def test_finished_in_step_n_but_scheduled_in_n_plus_1_is_dropped(llm, prompts, reference, k):
    """Stop tokens and stop strings end requests mid-pipeline: the step already scheduled for them is
    computed and discarded; outputs equal the synchronous loop's and nothing leaks."""
    params = []
    for i, tokens in enumerate(reference):
        stop_token = tokens[3 + i % 5]
        if i % 4 == 3:
            params.append(GREEDY)  # runs to max_tokens
        elif i % 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop_token,)))
        else:
            stop = llm.tokenizer.decode(tokens[: 4 + i % 5])[-2:]
            stops = (stop,) if stop.strip() else ()
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop=stops))
    expected = llm.generate(prompts, params)
    assert {o.finish_reason for o in expected} == {"stop", "length"}
    other = llm.replace_config(async_scheduling=True, num_speculative_tokens=k)
    history: list[SchedulerOutput] = []
    schedule = other.engine.scheduler.schedule

    def recording_schedule():
        history.append(schedule())
        return history[-1]

    other.engine.scheduler.schedule = recording_schedule
    outputs = other.generate(prompts, params)
    assert [(o.text, o.finish_reason) for o in outputs] == [(o.text, o.finish_reason) for o in expected]
    for out, ref, p in zip(outputs, expected, params, strict=True):
        if p.stop:  # with drafts a step commits several tokens, stop strings are found after the step
            assert out.token_ids[: len(ref.token_ids)] == ref.token_ids
        else:
            assert out.token_ids == ref.token_ids
    assert_nothing_left(other)
    if k:
        assert sum(o.drafts.num_draft_tokens for o in outputs) > 0
        return  # several tokens per step: the step counts below hold for k = 0
    wasted = 0
    for out in outputs:
        num_sampling_steps = sum(
            item.samples for step in history for item in step.scheduled if item.request_id == out.request_id
        )
        if out.finish_reason == "stop":
            assert num_sampling_steps == len(out.token_ids) + 1  # the step after its last token
            wasted += 1
        else:
            assert num_sampling_steps == len(out.token_ids)  # never scheduled past max_tokens
    assert wasted > 0


@pytest.mark.parametrize("k", [0, 2], ids=lambda k: f"k={k}")
def test_abort_while_a_step_is_in_flight(llm, prompts, reference, k):
    other = llm.replace_config(async_scheduling=True, num_speculative_tokens=k)
    engine = other.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts[:6]]
    results = {}
    for _ in range(3):
        for out in engine.step():
            results[out.request_id] = out
    assert engine._async_loop.has_step_in_flight
    for rid in ids[::2]:
        assert engine.abort_request(rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
    for out in engine.step():  # reports the aborted requests if no step did yet
        results[out.request_id] = out
    for i, rid in enumerate(ids):
        if i % 2 == 0:
            assert results[rid].finish_reason == "abort"
            assert results[rid].token_ids == reference[i][: len(results[rid].token_ids)]
        else:
            assert results[rid].token_ids == reference[i]
    assert_nothing_left(other)
    # Aborting every request drains the pipeline at once.
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    engine.step()
    engine.step()
    assert engine._async_loop.has_step_in_flight
    for rid in ids:
        engine.abort_request(rid)
    assert_nothing_left(other)


def test_blocks_freed_while_a_step_is_in_flight_stay_out_of_the_pool_until_it_is_done(llm, prompts):
    """The in-flight step may still write an aborted request's blocks: none of them (no cached content:
    prefix caching off) is handed out, e.g. to a remote prefill's reservation written from another thread,
    before the next `step()` has waited for that step."""
    other = llm.replace_config(async_scheduling=True, enable_prefix_caching=False)
    engine, blocks = other.engine, other.engine.scheduler.block_manager
    ids = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    engine.step()
    engine.step()
    assert engine._async_loop.has_step_in_flight
    held = blocks.block_ids(engine.scheduler.get_request(ids[0]))
    assert engine.abort_request(ids[0])
    blocks.check_invariants()
    assert not set(held) & set(blocks._free_block_ids)  # the step holding the request is in flight
    engine.step()  # waits for that step
    assert set(held) <= set(blocks._free_block_ids)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    assert_nothing_left(other)


@pytest.mark.parametrize("k", [0, 2], ids=lambda k: f"k={k}")
def test_preemption_under_kv_pressure_with_async_scheduling(llm, prompts, reference, k):
    tight = llm.replace_config(
        async_scheduling=True, num_kv_blocks=24, block_size=8, num_speculative_tokens=k
    )
    outputs = tight.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert sum(o.num_preemptions for o in outputs) > 0
    assert_nothing_left(tight)


def test_sampling_with_async_speculation_preserves_the_distribution(llm):
    """As `test_llm.test_sampling_with_speculation_preserves_the_distribution`, for the pipelined loop:
    600 seeded requests sample 3 tokens at temperature 1.0; the third token's distribution with async
    scheduling and k = 2 (drafts filled in by the worker, rejection sampling) must match the synchronous
    k = 0 one (two-sample chi-square test, alpha = 0.001)."""
    prompt = "def __init__(self, name, value):\n        self."
    num = 600

    def third_tokens(**changes) -> list[int]:
        engine_llm = llm.replace_config(max_num_seqs=600, num_kv_blocks=2048, **changes)
        params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(num)]
        outputs = engine_llm.generate([prompt] * num, params)
        return [o.token_ids[2] for o in outputs]

    a, b = third_tokens(), third_tokens(async_scheduling=True, num_speculative_tokens=2)
    tokens = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(t), b.count(t)] for t in tokens], dtype=torch.float64)
    rare = counts.sum(1) < 10  # pool rare tokens so that every expected count is >= 5
    if rare.any():
        counts = torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)])
    expected = counts.sum(1, keepdim=True) / 2  # equal sample sizes
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.shape[0] - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
    assert dof >= 2, "the test needs a spread-out distribution to mean anything"
    assert p_value > 0.001, f"chi-square {stat:.1f} with {dof} dof, p = {p_value:.2e}"
