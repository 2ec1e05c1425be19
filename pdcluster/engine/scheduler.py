"""The stateful scheduler shell: queues, the block manager, and applying `schedule_step`'s plan."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdcluster.engine.block_manager import BlockManager, ComputedBlocks
from pdcluster.engine.input_batch import RequestRows
from pdcluster.engine.outputs import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.request_step import (
    commit_decode_step,
    commit_decode_token,
    commit_sampled,
    commit_tokens,
    samples_last_token,
    schedule_decode,
    schedule_request,
)
from pdcluster.engine.scheduler_policy import (
    RequestView,
    SchedulerConfig,
    SchedulerStats,
    StepPlan,
    check_request_fits,
    schedule_step,
)


class Scheduler:
    """Owns the waiting and running queues, the reservations of requests prefilled elsewhere and, once
    admitted, their queue for a seat in the running batch (`waiting_for_seat`), the `BlockManager` of one
    engine instance, and the running requests' persistent rows (`request_rows`, an
    `engine.input_batch.RequestRows`: token ids, block tables, sampling parameters) that `schedule()`
    brings up to date for the step's inputs.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        clock: Callable[[], float] = time.monotonic,
        num_draft_placeholders: int = 0,
    ) -> None:
        self.config = config
        self.num_draft_placeholders = num_draft_placeholders
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching)
        max_num_positions = config.max_model_len + config.num_lookahead_tokens + 1
        self.request_rows = RequestRows(
            config.max_num_seqs,
            min(num_blocks, -(-max_num_positions // config.block_size)),
            max_num_positions,
        )
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._running_by_arrival: list[Request] | None = None  # `running` in arrival order, None: stale
        self.reserved: dict[str, Request] = {}
        self.waiting_for_seat: list[Request] = []
        self._arrival_index: dict[str, int] = {}
        self._num_arrived = 0
        self._finished_request_ids: list[str] = []
        self.num_preemptions = 0
        self._num_prefix_query_tokens = 0
        self._num_prefix_hit_tokens = 0

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError: duplicate request id, or a request that could never fit
        (`check_request_fits`: context length or the whole KV cache)."""
        self._check_new(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._arrival_index[request.request_id] = self._num_arrived
        self._num_arrived += 1
        self.waiting.append(request)

    def _check_new(self, request: Request, *taken: dict[str, Request]) -> None:
        """Raise ValueError for an id already in use (here or in `taken`) or a request that never fits."""
        if any(request.request_id in ids for ids in (self.requests, *taken)):
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        num_blocks, max_tokens = self.block_manager.num_blocks, request.sampling_params.max_tokens
        check_request_fits(self.config, num_blocks, request.num_prompt_tokens, max_tokens)

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> bool:
        """Finish a waiting or running request from outside a step (abort, stop string, a failed step:
        FINISHED_ERROR with `error`, the reason); frees its blocks.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status}")
        request = self.requests.get(request_id)
        if request is None:
            return False
        if error is not None:
            request.error = error
        self._remove(request, status)
        return True

    def abort(self, request_id: str) -> bool:
        """Abort a request (FINISHED_ABORTED)."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def reserve(self, request: Request, num_slots: int) -> bool:
        """Hold KV blocks for `num_slots` positions of a request whose prompt KV another instance computes.
        Raises ValueError: duplicate request id, or a request that could never fit (`check_request_fits`)."""
        self._check_new(request, self.reserved)
        if not self.block_manager.allocate_slots(request, num_slots):
            return False
        self.reserved[request.request_id] = request
        return True

    def release_reserved(self, request_id: str) -> bool:
        """Free a reservation's blocks (the handoff failed or was cancelled)."""
        request = self.reserved.pop(request_id, None)
        if request is None:
            return False
        self.block_manager.free(request)
        return True

    def admit_reserved(
        self, request_id: str, first_token_id: int, spec_token_ids: list[int]
    ) -> RequestStatus:
        """Admit a reserved request whose prompt KV is now in its blocks, as if this instance had run its
        prefill: `num_computed_tokens` = prompt length, the first token committed (stop conditions apply),
        `spec_token_ids` the drafts to verify in its next step.
        Raises KeyError: no such reservation."""
        request = self.reserved.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        now = self.clock()
        request.first_scheduled_time_s = request.first_scheduled_time_s or now
        request.num_cached_tokens = 0
        _, status = commit_tokens(request, [first_token_id], now)
        self.block_manager.cache_full_blocks(request)
        if status.is_finished:
            self.block_manager.free(request)
            request.status = status
            request.finished_time_s = now
            return status
        num_allowed = request.sampling_params.max_tokens - request.num_output_tokens - 1
        request.spec_token_ids = list(spec_token_ids)[: max(0, num_allowed)]
        request.status = RequestStatus.WAITING_FOR_SEAT
        self.requests[request_id] = request
        self._arrival_index[request_id] = self._num_arrived
        self._num_arrived += 1
        self.waiting_for_seat.append(request)
        return status

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> SchedulerStats:
        queried = self._num_prefix_query_tokens
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.waiting_for_seat),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_hit_rate=self._num_prefix_hit_tokens / queried if queried else None,
            num_prefix_cache_hit_tokens=self._num_prefix_hit_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        """Decide and prepare the next step: preempt, admit, allocate KV slots, advance `num_computed_tokens`
        of every scheduled request.
        """
        self._seat_admitted()
        output = self._schedule_decode()
        if output is not None:
            return output
        bm = self.block_manager
        num_candidates = max(0, self.config.max_num_seqs - len(self.running))
        candidates = sorted(self.waiting, key=lambda r: self._arrival_index[r.request_id])[:num_candidates]
        lookups: dict[str, ComputedBlocks] = {r.request_id: bm.get_computed_blocks(r) for r in candidates}
        # A request whose step in flight samples its last allowed token needs no further step.
        running = [r for r in self.running if not samples_last_token(r)]
        free_blocks = getattr(bm, "num_free_blocks_per_pool", bm.num_free_blocks)
        plan = None if candidates else self._decode_plan(running, free_blocks)
        if plan is not None:
            return self._apply(plan, lookups)
        waiting = [self._waiting_view(r, lookups[r.request_id]) for r in candidates]
        plan = schedule_step(
            self.config, [self._running_view(r, False) for r in running], waiting, free_blocks
        )
        if plan.preempted_request_ids:
            views = [self._running_view(r, True) for r in running]
            plan = schedule_step(self.config, views, waiting, free_blocks)
        return self._apply(plan, lookups)

    def _schedule_decode(self) -> SchedulerOutput | None:
        """`schedule()` in one pass when every running request decodes one token without drafts; else None."""
        bm, running, config = self.block_manager, self.running, self.config
        # no seat or nobody waiting: `_decode_plan`'s case
        seated = not self.waiting or len(running) >= config.max_num_seqs
        if not (running and seated) or self.num_draft_placeholders or config.num_lookahead_tokens:
            return None
        if len(running) > config.max_num_batched_tokens or type(bm) is not BlockManager:
            return None
        order = self._running_by_arrival
        if order is None:
            arrival = self._arrival_index
            order = self._running_by_arrival = sorted(running, key=lambda r: arrival[r.request_id])
        step = schedule_decode(order, bm, config.block_size)
        if step is None:
            return None
        scheduled = step.scheduled
        rows = self.request_rows.add_decode_step(order, step) or self.request_rows.add_step(scheduled)
        finished, self._finished_request_ids = self._finished_request_ids, []
        num_scheduled_tokens = dict.fromkeys([r.request_id for r in order], 1)
        return SchedulerOutput(scheduled, num_scheduled_tokens, len(order), [], [], finished, rows)

    def _decode_plan(self, running: list[Request], free_blocks: int | list[int]) -> StepPlan | None:
        """`schedule_step`'s plan when nothing waits and every running request decodes within the token
        budget and the free blocks (no chunking, no preemption); None otherwise.
        """
        bs, budget = self.config.block_size, self.config.max_num_batched_tokens
        arrival, bm = self._arrival_index, self.block_manager
        free = [free_blocks] if isinstance(free_blocks, int) else list(free_blocks)
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, int] = {}
        held = bm.num_blocks_held
        for r in sorted(running, key=lambda r: arrival[r.request_id]):
            num_computed, num_known = r.num_computed_tokens, r.num_tokens + r.num_output_placeholders
            num_new = num_known + len(r.spec_token_ids) - num_computed  # `num_tokens_to_compute`
            if budget == 0 or num_new > budget or num_computed < num_known - 1:
                return None
            num_blocks = max(0, -(-(num_computed + num_new) // bs) - held(r))
            if num_blocks > free[r.kv_pool]:
                return None
            scheduled[r.request_id], new_blocks[r.request_id] = num_new, num_blocks
            budget -= num_new
            free[r.kv_pool] -= num_blocks
        return StepPlan(scheduled, new_blocks, {}, (), sum(free))

    def _seat_admitted(self) -> None:
        """Move remotely prefilled admitted requests into `running`, oldest first, up to max_num_seqs."""
        num_seats = self.config.max_num_seqs - len(self.running)
        if num_seats <= 0 or not self.waiting_for_seat:
            return
        seated, self.waiting_for_seat = self.waiting_for_seat[:num_seats], self.waiting_for_seat[num_seats:]
        for request in seated:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        self._running_by_arrival = None

    def _running_view(self, request: Request, count_exclusive: bool) -> RequestView:
        num_known = request.num_tokens + request.num_output_placeholders
        bm = self.block_manager
        return RequestView(
            request_id=request.request_id,
            arrival_index=self._arrival_index[request.request_id],
            num_computed_tokens=request.num_computed_tokens,
            num_tokens_to_compute=request.num_tokens_to_compute,
            is_prefill=request.num_computed_tokens < num_known - 1,
            num_blocks_held=bm.num_blocks_held(request),
            num_blocks_exclusive=bm.num_exclusive_blocks(request) if count_exclusive else 0,
            pool=request.kv_pool,
        )

    def _waiting_view(self, request: Request, computed: ComputedBlocks) -> RequestView:
        return RequestView(
            request_id=request.request_id,
            arrival_index=self._arrival_index[request.request_id],
            num_computed_tokens=request.num_computed_tokens,
            num_tokens_to_compute=request.num_tokens_to_compute,
            num_cached_tokens=computed.num_cached_tokens,
            num_cached_blocks_evictable=computed.num_evictable_blocks,
            pool=request.kv_pool,
        )

    def _apply(self, plan: StepPlan, lookups: dict[str, ComputedBlocks]) -> SchedulerOutput:
        bm, now = self.block_manager, self.clock()
        for request_id in plan.preempted_request_ids:
            self._preempt(self.requests[request_id])

        for request_id in plan.admitted:
            request, computed = self.requests[request_id], lookups[request_id]
            if not bm.allocate_slots(request, 0, computed):
                raise RuntimeError(f"scheduler plan not applicable: prefix hit of {request_id!r}")
            request.num_computed_tokens = computed.num_cached_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed.num_cached_tokens
            if request.first_scheduled_time_s is None:
                request.first_scheduled_time_s = now
            self._num_prefix_query_tokens += request.num_tokens
            self._num_prefix_hit_tokens += computed.num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.waiting.remove(request)
            self.running.append(request)
            self._running_by_arrival = None

        scheduled = [
            schedule_request(self.requests[request_id], num_new_tokens, bm, self.num_draft_placeholders)
            for request_id, num_new_tokens in plan.num_scheduled_tokens.items()
        ]
        if self.config.num_lookahead_tokens:
            # Best effort, after every planned allocation: a request that gets no lookahead drafts less.
            for item in scheduled:
                if item.samples and bm.allocate_slots(item.request, self.config.num_lookahead_tokens):
                    item.block_ids[:] = bm.block_ids(item.request)

        finished, self._finished_request_ids = self._finished_request_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=dict(plan.num_scheduled_tokens),
            total_num_scheduled_tokens=plan.total_num_scheduled_tokens,
            new_request_ids=list(plan.admitted),
            preempted_request_ids=list(plan.preempted_request_ids),
            finished_request_ids=finished,
            rows=self.request_rows.add_step(scheduled) if scheduled else None,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Commit the step's tokens: roll back rejected drafts, apply stop conditions, cache full blocks, free
        finished requests, take the next drafts.
        Raises ValueError: the runner returned no token for a request whose step reached its last token,
        more tokens than drafts + 1, or "accepted" tokens that differ from the drafts."""
        bm, now = self.block_manager, self.clock()
        updates: list[RequestUpdate] = []
        requests, failed = self.requests, runner_output.failed
        sampled, drafts = runner_output.sampled_token_ids, runner_output.spec_token_ids
        running, num_draft_placeholders = RequestStatus.RUNNING, self.num_draft_placeholders
        rows = scheduler_output.rows
        decode_block_size = self.config.block_size if rows is not None and rows.decode is not None else 0
        if decode_block_size and not (failed or drafts or num_draft_placeholders):
            return commit_decode_step(
                scheduler_output.scheduled, sampled, requests, bm, now, decode_block_size, self._remove
            )
        for item in scheduler_output.scheduled:
            request = item.request
            request_id = request.request_id
            if (
                requests.get(request_id) is not request
                or request.status is not running
                or request.num_preemptions != item.num_preemptions
            ):
                continue
            error = failed.get(request_id) if failed else None
            if error is not None:
                request.error = error
                self._remove(request, RequestStatus.FINISHED_ERROR)
                updates.append(RequestUpdate(request_id, [], RequestStatus.FINISHED_ERROR))
                continue
            if not item.samples:
                bm.cache_full_blocks(request)
                continue
            new_token_ids = sampled.get(request_id, ())
            if len(new_token_ids) == 1 and not (item.spec_token_ids or num_draft_placeholders or drafts):
                status = commit_decode_token(request, new_token_ids, bm, now, decode_block_size)
            else:
                new_token_ids, status = commit_sampled(
                    item, list(new_token_ids), drafts.get(request_id, []), bm, num_draft_placeholders, now
                )
            if status is not running:
                self._remove(request, status)
            updates.append(RequestUpdate(request_id, new_token_ids, status))
        return updates

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: free the blocks (full ones stay cached), requeue from token 0."""
        self.block_manager.free(request)
        self.request_rows.remove([request.request_id])
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(request)
        self._running_by_arrival = None
        self.waiting.append(request)

    def _remove(self, request: Request, status: RequestStatus) -> None:
        self.block_manager.free(request)
        self.request_rows.remove([request.request_id])
        request.num_output_placeholders = 0
        queues = {RequestStatus.RUNNING: self.running, RequestStatus.WAITING_FOR_SEAT: self.waiting_for_seat}
        queues.get(request.status, self.waiting).remove(request)
        self._running_by_arrival = None
        request.status = status
        request.finished_time_s = self.clock()
        del self.requests[request.request_id]
        del self._arrival_index[request.request_id]
        self._finished_request_ids.append(request.request_id)
