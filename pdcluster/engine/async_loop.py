"""Asynchronous scheduling: the CPU prepares step N+1 while step N's forward runs.

`LLMEngine` with `EngineConfig.async_scheduling=True` drives its steps through `AsyncStepLoop`. One step
is in flight at a time on a single worker thread; torch ops release the GIL, so the main thread's Python
work (scheduling, packing inputs, committing tokens, detokenizing) overlaps the forward for real.

Who runs what, in one `LLMEngine.step()` call (step N was submitted by the previous call):

    main thread                                          worker thread
    -----------                                          -------------
    scheduler.schedule()        -> step N+1              executor.run(N): forward, sample
      (a request whose step N samples holds output            (verify drafts, propose drafts)
       placeholders; its N+1 inputs are
       PLACEHOLDER_TOKEN_IDs)
    executor.prepare(N+1)       pack into buffer set B   (run(N) reads buffer set A)
    submit executor.run(N+1)    queued behind run(N)
    wait for run(N)
    scheduler.update_from_output(N): commit, stop,       executor.run(N+1): first resolves the
      roll back rejected drafts, free finished             placeholders from N's results, then
      requests' blocks                                     forward
    engine: detokenize, stop strings, RequestOutputs
    return step N's outputs
    (between calls: add_request, abort_request)

So outputs lag one call behind the synchronous loop (the first call returns only aborted requests), and
the tokens are the same: step N+1's inputs are exactly N's samples.

With speculative decoding (k > 0), step N yields 1 to k_N + 1 tokens and proposes the drafts step N+1
verifies, all unknown when step N+1 is scheduled. The scheduler places step N+1 as if every draft of step
N were accepted (`1 + k_N` output placeholders) and gives it a bonus placeholder plus k draft placeholders
(fewer near `max_tokens`). The worker fills them in (bonus token, then step N's drafts) and moves the
request's positions, slots and sequence length back by the drafts step N rejected; committing step N
rolls `num_computed_tokens` back by the same count, so both sides agree. Slots that step N+1 had
reserved past its real end (lookahead for chained MTP drafts) may be freed by that rollback while step
N+1 still writes MTP-layer KV there. So a block without cached content freed while a step is in flight
(rollback, a finished, aborted or preempted request) stays out of the free pool until that step is done
(`BlockManager.defer_frees`): no new owner, a remote prefill's reservation written from another thread
included, gets a block a running step may still write. A request left out of step N+1 for lack of token
budget runs step N's drafts as known tokens in a later step.

A request that finished in step N (EOS, stop token, stop string; not max_tokens: a request whose step
in flight may sample its `max_tokens`-th token is not scheduled again until that step is committed) but
was already scheduled in N+1: `update_from_output(N)`
finishes it and frees its blocks while N+1 computes it (those without cached content out of the pool until
N+1 is done, as above), and its sample for the
request is discarded by `update_from_output(N+1)`, which skips requests that are no longer running. The
same holds for a request aborted or preempted while a step holding it is in flight. The executor drops
such a request's state (generator, draft distributions) in the first step scheduled after the request
finished, which runs after every step that still holds it.

Draining: when no request is left after a call (or after an abort), the in-flight step is awaited and
discarded, then an empty step hands the finished request ids to the executor, so nothing outlives its
request and no work is left running.
"""

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
    freed: list[int]  # blocks freed while it runs, out of the pool until it is done (`defer_frees`)


class AsyncStepLoop:
    """Pipelines `Scheduler` and `Executor` one step deep (see the module docstring).

    The scheduler and the requests belong to the caller's thread; the executor's `run` and per-request
    state belong to the worker thread while a step is in flight.
    """

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
        """Schedule and submit the next step, then commit the step in flight.

        Returns:
            The committed step's `SchedulerOutput` and `ModelRunnerOutput` (both None when none was in
            flight) and its updates.
        """
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
        """Once no request is left: wait for the step in flight and discard it, then let the executor
        drop the state of finished requests (an empty step). Afterwards the worker is idle.

        Raises:
            RuntimeError: a request is still unfinished (its tokens would be lost).
        """
        if self.scheduler.has_unfinished():
            raise RuntimeError("drain() with unfinished requests; call step() until none is left")
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self.scheduler.update_from_output(previous.output, previous.result.result())
            self.scheduler.block_manager.release_deferred(previous.freed, stop=True)
        self.executor.execute(self.scheduler.schedule())  # the worker is idle: safe on this thread

    def shutdown(self) -> None:
        """Stop the worker thread after the step in flight (whose results are dropped)."""
        self._pool.shutdown(wait=True)
        if self._in_flight is not None:
            self.scheduler.block_manager.release_deferred(self._in_flight.freed, stop=True)
        self._in_flight = None
