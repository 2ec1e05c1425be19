"""Asynchronous scheduling: the CPU prepares step N+1 while step N's forward runs."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from pdcluster.engine.executor import Executor
from pdcluster.engine.model_runner import LayerKVCallback
from pdcluster.engine.outputs import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from pdcluster.engine.scheduler import Scheduler


class _InFlight(NamedTuple):
    output: SchedulerOutput
    result: Future[ModelRunnerOutput]
    freed: list[int]


class AsyncStepLoop:
    """Pipelines `Scheduler` and `Executor` one step deep (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdcluster-step")
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
            future = self._pool.submit(self.executor.run, output, prepared, on_layer_kv)
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
        """Once no request is left: wait for the step in flight and discard it, then let the executor drop the
        state of finished requests (an empty step).

        Raises:
            RuntimeError: a request is still unfinished (its tokens would be lost).
        """
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
