"""Factories for engine tests: requests, block managers, schedulers, a fake clock and a fake model runner."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.model_runner import InputBuffers
from pdcluster.engine.outputs import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.scheduler_policy import SchedulerConfig


class FakeClock:
    """A settable clock in seconds."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


@pytest.fixture
def make_request() -> Callable[..., Request]:
    """`make_request(request_id, prompt=None, num_prompt_tokens=8, max_tokens=16, eos_token_id=None,
    **sampling)`: without `prompt`, the tokens are fresh ids never used by another request of the test."""
    fresh_ids = itertools.count(1000)

    def make(
        request_id: str = "r0",
        prompt: list[int] | None = None,
        num_prompt_tokens: int = 8,
        max_tokens: int = 16,
        eos_token_id: int | None = None,
        **sampling,
    ) -> Request:
        if prompt is None:
            prompt = [next(fresh_ids) for _ in range(num_prompt_tokens)]
        return Request(
            request_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, **sampling),
            eos_token_id=eos_token_id,
            arrival_time_s=0.0,
        )

    return make


@pytest.fixture
def make_scheduler() -> Callable[..., Scheduler]:
    """`make_scheduler(num_blocks=64, enable_prefix_caching=True, clock=None, **config)`, default config:
    block_size 4, budget 32 tokens, 8 sequences, max_model_len 256."""

    def make(
        num_blocks: int = 64, enable_prefix_caching: bool = True, clock: FakeClock | None = None, **config
    ) -> Scheduler:
        config = dict(
            dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256), **config
        )
        return Scheduler(SchedulerConfig(**config), num_blocks, enable_prefix_caching, clock or FakeClock())

    return make


def compute(block_manager: BlockManager, request: Request, num_new_tokens: int, computed=None) -> None:
    """What the scheduler and runner do to a request's KV in one step: allocate, compute, cache."""
    args = (computed,) if computed is not None else ()
    assert block_manager.allocate_slots(request, num_new_tokens, *args)
    if computed is not None:
        request.num_computed_tokens = computed.num_cached_tokens
    request.num_computed_tokens += num_new_tokens
    block_manager.cache_full_blocks(request)


def fake_runner_output(
    output: SchedulerOutput,
    next_token: Callable[[str], int] = lambda request_id: 7,
    num_accepted: Callable[[str, int], int] = lambda request_id, num_drafts: num_drafts,
    drafts: Callable[[str], list[int]] = lambda request_id: [],
) -> ModelRunnerOutput:
    """Tokens for every sampling request: `num_accepted(id, num_drafts)` drafts then `next_token(id)`;
    `drafts(id)` proposes the next step's drafts."""
    sampled, spec = {}, {}
    for item in output.scheduled:
        if item.samples:
            accepted = item.spec_token_ids[: num_accepted(item.request_id, len(item.spec_token_ids))]
            sampled[item.request_id] = accepted + [next_token(item.request_id)]
            spec[item.request_id] = drafts(item.request_id)
    return ModelRunnerOutput(sampled, spec)


def check_packed_rows(output: SchedulerOutput, block_size: int) -> None:
    """The step packed from the scheduler's persistent rows (`InputBuffers.pack_rows`, what the executor
    runs) equals the reference packing of the items' per-request lists (`token_ids`, `start_position`,
    `block_ids`), field by field; the slots also equal each item's `slot_mapping`. Call it right after
    `schedule()` (the rows change at the next schedule or commit)."""
    items = output.scheduled
    if not items:
        assert output.rows is None
        return
    num_tokens = sum(item.num_scheduled_tokens for item in items)
    num_columns = max(len(item.block_ids) for item in items)
    token_ids = [item.token_ids for item in items]
    assert [len(t) for t in token_ids] == [item.num_scheduled_tokens for item in items]
    want = InputBuffers(num_tokens, len(items), num_columns, block_size).pack(
        token_ids, [item.start_position for item in items], [item.block_ids for item in items]
    )
    got = InputBuffers(num_tokens, len(items), num_columns, block_size).pack_rows(output.rows)
    for name, expected, packed in zip(want._fields, want, got, strict=True):
        assert packed.tolist() == expected.tolist(), name
    slots = [slot for item in items for slot in item.slot_mapping(block_size)]
    assert got.slot_mapping.tolist() == slots


def step(scheduler: Scheduler, **runner) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """One engine step with `fake_runner_output(**runner)`; checks the packed rows
    (`check_packed_rows`)."""
    output = scheduler.schedule()
    check_packed_rows(output, scheduler.config.block_size)
    return output, scheduler.update_from_output(output, fake_runner_output(output, **runner))
