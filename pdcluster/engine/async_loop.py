"""Asynchronous scheduling: the CPU prepares step N+1 while step N's forward runs.

One worker thread runs the steps in order. A step's result is handed to the engine thread once the next
step reaches its forward (or at once when none is queued), so the worker's work between two forwards does
not wait on the engine thread's GIL.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from pdcluster.engine.executor import Executor
from pdcluster.engine.model_runner import LayerKVCallback
from pdcluster.engine.outputs import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.step_inputs import PreparedStep


class _InFlight(NamedTuple):
    output: SchedulerOutput
    result: Future[ModelRunnerOutput]
    freed: list[int]


_Job = tuple[SchedulerOutput, PreparedStep, LayerKVCallback | None, "Future[ModelRunnerOutput]"]


class AsyncStepLoop:
    """Pipelines `Scheduler` and `Executor` one step deep (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdcluster-step")
        self._worker = _Worker(executor)
        self._in_flight: _InFlight | None = None

    @property
    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def step(
        self, on_layer_kv: LayerKVCallback | None = None
    ) -> tuple[SchedulerOutput | None, ModelRunnerOutput | None, list[RequestUpdate]]:
        """Schedule and submit the next step, then commit the step in flight."""
        blocks = self.scheduler.block_manager
        output = self.scheduler.schedule()
        submitted = None
        if output.scheduled or output.finished_request_ids or output.preempted_request_ids:
            prepared = self.executor.prepare(output)
            future: Future[ModelRunnerOutput] = Future()
            self._worker.jobs.put((output, prepared, on_layer_kv, future))
            self._pool.submit(self._worker.run_next)
            submitted = _InFlight(output, future, blocks.defer_frees())
        previous, self._in_flight = self._in_flight, submitted
        if previous is None:
            return None, None, []
        runner_output = previous.result.result()
        blocks.release_deferred(previous.freed, stop=submitted is None)
        return (
            previous.output,
            runner_output,
            self.scheduler.update_from_output(previous.output, runner_output),
        )

    def drain(self) -> None:
        """Once no request is left: discard the step in flight, then let the executor drop finished
        requests' state (an empty step). Raises RuntimeError: a request is still unfinished."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("drain() with unfinished requests; call step() until none is left")
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self.scheduler.update_from_output(previous.output, previous.result.result())
            self.scheduler.block_manager.release_deferred(previous.freed, stop=True)
        self.executor.execute(self.scheduler.schedule())

    def shutdown(self) -> None:
        """Stop the worker thread after the step in flight (whose results are dropped)."""
        self._pool.shutdown(wait=True)
        if self._in_flight is not None:
            self.scheduler.block_manager.release_deferred(self._in_flight.freed, stop=True)
        self._in_flight = None


class _Worker:
    """Steps submitted to the worker thread, run in order; a result is handed over when the next step's
    forward starts (`Executor.run`'s `before_forward`) or fails, or at once if none waits."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._held: list[tuple[Future[ModelRunnerOutput], ModelRunnerOutput]] = []

    def hand_over(self) -> None:
        while self._held:
            future, result = self._held.pop()
            future.set_result(result)

    def run_next(self) -> None:
        output, prepared, on_layer_kv, future = self.jobs.get_nowait()
        try:
            result = self.executor.run(output, prepared, on_layer_kv, before_forward=self.hand_over)
        except BaseException as e:  # noqa: BLE001 - the engine thread re-raises it from the future
            self.hand_over()
            future.set_exception(e)
            return
        self.hand_over()  # a step without a forward
        self._held.append((future, result))
        if self.jobs.empty():
            self.hand_over()
