"""Asynchronous scheduling (engine/async_loop.py): step N+1 is scheduled before step N's tokens are known.

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

from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_runner import InputBuffers, build_model_input
from engine.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from models import bundled_checkpoint_dir
from models.prompts import heldout_def_prompts

EOS = 100


def true_token(request_id: str, position: int) -> int:
    """The fake model's token at `position` (>= the prompt length) of a request: 100..149, 100 is EOS."""
    return 100 + (sum(map(ord, request_id)) * 31 + position * 7 + position * position) % 50


class FakeExecutor:
    """Replaces placeholders by its previous step's samples (as `Executor.run` does), checks every input
    against `true_token`, and samples `true_token` at the next position."""

    def __init__(self, prompts: dict[str, list[int]]) -> None:
        self.prompts = prompts
        self.last_sampled: dict[str, int] = {}
        self.num_placeholders = 0

    def run(self, output: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for item in output.scheduled:
            rid, prompt = item.request_id, self.prompts[item.request_id]
            for offset, token in enumerate(item.token_ids):
                position = item.start_position + offset
                if token == PLACEHOLDER_TOKEN_ID:
                    token = self.last_sampled[rid]
                    self.num_placeholders += 1
                expected = prompt[position] if position < len(prompt) else true_token(rid, position)
                assert token == expected, f"{rid} position {position}: input {token}, expected {expected}"
            if item.samples:
                sampled[rid] = [true_token(rid, item.start_position + item.num_scheduled_tokens)]
        self.last_sampled = {rid: tokens[-1] for rid, tokens in sampled.items()}
        return ModelRunnerOutput(sampled)


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
        assert all(r.num_output_placeholders <= 1 for r in scheduler.running)  # only step N's
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
def test_pipelined_scheduler_commits_what_sync_commits(make_scheduler, make_request, seed, num_blocks):
    results = {}
    for mode in ("sync", "async"):
        scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16, max_num_seqs=6)
        prompts = add_workload(scheduler, make_request, seed)
        requests = dict(scheduler.requests)
        fake = FakeExecutor(prompts)
        if mode == "sync":
            run_sync(scheduler, fake)
            assert fake.num_placeholders == 0
        else:
            run_pipelined(scheduler, fake)
            assert fake.num_placeholders > 0
        scheduler.block_manager.check_no_leaks()
        assert all(r.num_output_placeholders == 0 for r in requests.values())
        results[mode] = {rid: (r.output_token_ids, r.status) for rid, r in requests.items()}
        if num_blocks == 14 and mode == "async":
            assert scheduler.num_preemptions > 0
    assert results["async"] == results["sync"]
    statuses = {status for _, status in results["sync"].values()}
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
def test_aborts_and_preemptions_while_a_step_is_in_flight_leak_nothing(make_scheduler, make_request, seed):
    scheduler = make_scheduler(num_blocks=14, max_num_batched_tokens=16, max_num_seqs=6)
    prompts = add_workload(scheduler, make_request, seed)
    requests = dict(scheduler.requests)
    rng = random.Random(seed)

    def abort(step: int) -> list[str]:
        alive = sorted(scheduler.requests)
        return rng.sample(alive, 1) if alive and rng.random() < 0.2 else []

    run_pipelined(scheduler, FakeExecutor(prompts), abort)
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


def test_async_with_speculative_decoding_is_rejected():
    with pytest.raises(ValueError, match="async_scheduling with num_speculative_tokens > 0 is not supported"):
        EngineConfig(model="x", async_scheduling=True, num_speculative_tokens=2)


def test_forward_of_step_n_overlaps_scheduling_of_step_n_plus_1(llm, prompts, reference):
    """Each step's execution on the worker waits (up to 30 s) until the main thread has scheduled the
    following step. A synchronous loop could never get there; the pipeline always does (except for the
    step still in flight when the last request finishes: the drain waits for it)."""
    other = llm.replace_config(async_scheduling=True)
    engine, loop = other.engine, other.engine._async_loop
    changed = threading.Condition()
    schedule_index: dict[int, int] = {}  # id(SchedulerOutput) -> its schedule() call number
    num_scheduled, draining, overlapped = [0], [False], []
    schedule, run, drain = engine.scheduler.schedule, engine.executor.run, loop.drain

    def counting_schedule():
        output = schedule()
        with changed:
            schedule_index[id(output)] = num_scheduled[0]
            num_scheduled[0] += 1
            changed.notify_all()
        return output

    def waiting_run(output, prepared, on_layer_kv=None):
        if output.scheduled:
            assert threading.current_thread() is not threading.main_thread()
            with changed:
                next_index = schedule_index[id(output)] + 1
                changed.wait_for(lambda: num_scheduled[0] > next_index or draining[0], timeout=30)
                overlapped.append(num_scheduled[0] > next_index)
        return run(output, prepared, on_layer_kv)

    def flagged_drain():
        with changed:
            draining[0] = True
            changed.notify_all()
        drain()

    engine.scheduler.schedule, engine.executor.run, loop.drain = counting_schedule, waiting_run, flagged_drain
    outputs = other.generate(prompts[:4], GREEDY)
    assert [o.token_ids for o in outputs] == reference[:4]
    assert len(overlapped) > 4 and sum(overlapped) >= len(overlapped) - 1


def test_finished_in_step_n_but_scheduled_in_n_plus_1_is_dropped(llm, prompts, reference):
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
    other = llm.replace_config(async_scheduling=True)
    history: list[SchedulerOutput] = []
    schedule = other.engine.scheduler.schedule

    def recording_schedule():
        history.append(schedule())
        return history[-1]

    other.engine.scheduler.schedule = recording_schedule
    outputs = other.generate(prompts, params)
    got = [(o.token_ids, o.text, o.finish_reason) for o in outputs]
    assert got == [(o.token_ids, o.text, o.finish_reason) for o in expected]
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
    assert_nothing_left(other)


def test_abort_while_a_step_is_in_flight(llm, prompts, reference):
    other = llm.replace_config(async_scheduling=True)
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


def test_preemption_under_kv_pressure_with_async_scheduling(llm, prompts, reference):
    tight = llm.replace_config(async_scheduling=True, num_kv_blocks=24, block_size=8)
    outputs = tight.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert sum(o.num_preemptions for o in outputs) > 0
    assert_nothing_left(tight)
