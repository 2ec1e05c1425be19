"""Growing back: the survivors switch to the grown group after one agreed step over the old group."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from pdcluster.engine.expert_parallel import ExpertParallelRuntime, load_rank_shard
from pdcluster.engine.grow_vote import GrowVote
from pdcluster.engine.parallel import ParallelConfig
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.workers.elastic_rank import _at_agreed_step
from tests.orchestrator.test_elastic import GROUP_TIMEOUT_S, _groups

NUM_STEPS = 40


class _Engine:
    """An engine's step as the worker's engine thread sees it: the real step agreement, then nothing."""

    def __init__(self, runtime: ExpertParallelRuntime) -> None:
        self.ep, self.steps = runtime, 0

    def step(self) -> list:
        self.ep.begin_step(False, 0)
        self.steps += 1
        return []


def _survivors(world: int) -> list[SimpleNamespace]:
    path = str(bundled_checkpoint_dir())
    workers = []
    for rank, group in enumerate(_groups(world)):
        parallel = ParallelConfig(expert_parallel_size=world, rank=rank, num_redundant_experts=world % 2)
        model, placement = load_rank_shard(path, parallel, "cpu", torch.float32)
        engine = _Engine(ExpertParallelRuntime(model, parallel, group, placement))
        workers.append(SimpleNamespace(name=f"decode-0.{rank}", engine=engine, lockstep=True))
        workers[-1]._wake_engine_thread = lambda: None
    return workers


def _run(workers, ready_at: list[int], aborted_at: list[int | None]) -> tuple[list, list]:
    """Each survivor's engine thread steps NUM_STEPS times in lockstep; its grow thread votes ready once
    that thread passed step `ready_at[r]`; `abort_grow` reaches it before step `aborted_at[r]`. Returns
    the step each survivor switched before (None: it did not) and what each grow raised."""
    switched: list = [None] * len(workers)
    errors: list = [None] * len(workers)
    step_events = [[threading.Event() for _ in range(NUM_STEPS + 1)] for _ in workers]
    votes = [GrowVote() for _ in workers]

    def engine_thread(r: int) -> None:
        for i in range(NUM_STEPS):
            if i == aborted_at[r]:
                votes[r].abort()  # as `RankWorker.abort_grow` does
            step_events[r][i].set()
            workers[r].engine.step()  # (the hook `_at_agreed_step` installs, once installed)
        step_events[r][NUM_STEPS].set()

    def grow_thread(r: int) -> None:
        worker, vote = workers[r], votes[r]
        step_events[r][ready_at[r]].wait(60)
        worker.engine.ep.grow_vote = vote

        def switch() -> None:
            switched[r] = worker.engine.steps

        try:
            _at_agreed_step(worker, vote, switch, GROUP_TIMEOUT_S, lambda: False)
        except RuntimeError as e:
            errors[r] = e

    threads = [threading.Thread(target=engine_thread, args=(r,)) for r in range(len(workers))]
    threads += [threading.Thread(target=grow_thread, args=(r,)) for r in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return switched, errors


def test_survivors_ready_at_different_steps_switch_after_the_same_step() -> None:
    """Three survivors see the newcomers loaded at steps 2, 6 and 11: all switch before the same step, the
    one after the first step every vote was in."""
    switched, errors = _run(_survivors(3), ready_at=[2, 6, 11], aborted_at=[None] * 3)
    assert errors == [None] * 3
    assert switched[0] is not None and switched == [switched[0]] * 3 and 11 < switched[0] < NUM_STEPS


def test_an_abort_reaching_one_survivor_before_the_others_are_ready_switches_none() -> None:
    """The driver's abort reaches survivor 0 at step 3, the others later; survivor 2 is ready at step 8."""
    switched, errors = _run(_survivors(3), ready_at=[1, 1, 8], aborted_at=[3, 20, 30])
    assert switched == [None] * 3
    assert all("aborted" in str(e) for e in errors)


@pytest.mark.parametrize("abort_at", [1, 2, 3, 4])
def test_an_abort_racing_the_agreement_switches_every_survivor_or_none(abort_at: int) -> None:
    """Whichever step the abort reaches survivor 2 at: all switch before one step, or none switches."""
    switched, errors = _run(
        _survivors(3), ready_at=[1, 2, 2], aborted_at=[abort_at + 20, abort_at + 20, abort_at]
    )
    if switched[0] is None:
        assert switched == [None] * 3 and all(e is not None for e in errors)
    else:
        assert switched == [switched[0]] * 3 and errors == [None] * 3
