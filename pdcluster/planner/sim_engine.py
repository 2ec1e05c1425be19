"""One simulated engine instance: its queues and KV blocks, stepped by the live scheduler policy.

Each step builds `RequestView`s as `Scheduler` does, calls the live `schedule_step`, prices the plan with a
`StepTimeModel` and commits tokens as `Scheduler.update_from_output` does (MTP drafts accepted by a seeded
draw per position). Left out: prefix caching (traces carry no text), chained-MTP lookahead slots, async
scheduling. An instance is one scheduler over all its DP ranks' blocks; rank imbalance is the step model's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pdcluster.engine.scheduler_policy import RequestView, SchedulerConfig, cdiv, schedule_step
from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape, StepTimeModel


class LengthOnlyPrompt(Sequence[int]):
    """A prompt known by its length only (traces carry no text), so prefix hits are 0."""

    __slots__ = ("_len",)

    def __init__(self, num_tokens: int) -> None:
        self._len = num_tokens

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        if isinstance(index, slice):
            return []
        raise IndexError("a LengthOnlyPrompt has no token ids")


class SimRequest:
    """One request's state through the simulated cluster (seconds; counts as `engine.request`)."""

    __slots__ = (
        "request_id",
        "index",
        "num_prompt_tokens",
        "max_tokens",
        "arrival_s",
        "deadline_s",
        "prefill_instance",
        "decode_instance",
        "arrival_index",
        "num_computed_tokens",
        "num_output_tokens",
        "num_spec_tokens",
        "num_blocks_held",
        "num_reserved_blocks",
        "num_preemptions",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_kept_tokens",
        "prefill_queued_s",
        "prefill_start_s",
        "prefill_end_s",
        "first_token_s",
        "admitted_s",
        "last_token_s",
        "finished_s",
        "error",
        "arrived_idle",
    )

    def __init__(self, index: int, num_prompt_tokens: int, max_tokens: int, arrival_s: float) -> None:
        self.request_id = f"sim-{index}"
        self.index = index
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.arrival_s = arrival_s
        self.deadline_s = arrival_s
        self.prefill_instance = -1
        self.decode_instance = -1
        self.arrival_index = -1
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_spec_tokens = 0
        self.num_blocks_held = 0
        self.num_reserved_blocks = 0  # held on decode from the reservation until admission
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_kept_tokens = 0  # streamed before a rank loss, recomputed as prompt (`planner.rank_loss`)
        self.prefill_queued_s: float | None = None
        self.prefill_start_s: float | None = None
        self.prefill_end_s: float | None = None
        # at the client: the prefill reply's time (`driver.dispatch.Prefilled` with `emit`), or the admission
        self.first_token_s: float | None = None
        self.admitted_s: float | None = None  # on decode
        self.last_token_s: float | None = None
        self.finished_s: float | None = None
        self.error: str | None = None
        self.arrived_idle = False  # no other request in flight at its arrival (`ControlPlane`'s idle extra)


def num_kv_blocks(kv_cache_memory_bytes: int, kv_cache_bytes_per_token: int, block_size: int) -> int:
    """KV blocks one device holds, as `engine.llm_engine.LLMEngine` sizes its cache (at least 1)."""
    return max(1, kv_cache_memory_bytes // (kv_cache_bytes_per_token * block_size))


class SimEngine:
    """One prefill or decode instance over `num_blocks` KV blocks; `acceptance_per_position` (decode only):
    P(draft i accepted | drafts < i were)."""

    def __init__(
        self,
        role: str,
        instance: int,
        config: SchedulerConfig,
        num_blocks: int,
        model: StepTimeModel,
        num_speculative_tokens: int = 0,
        acceptance_per_position: Sequence[float] = (),
        rng: random.Random | None = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if role == "decode" and len(acceptance_per_position) < num_speculative_tokens:
            raise ValueError(
                f"acceptance_per_position has {len(acceptance_per_position)} entries, "
                f"num_speculative_tokens is {num_speculative_tokens}"
            )
        self.role = role
        self.instance = instance
        self.config = config
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.model = model
        self.k = num_speculative_tokens
        self.acceptance = tuple(acceptance_per_position[:num_speculative_tokens])
        self.rng = rng or random.Random(0)
        self.requests: dict[str, SimRequest] = {}
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.waiting_for_seat: list[SimRequest] = []
        self.pending_admissions: list[SimRequest] = []
        self.pending_reserves: list[SimRequest] = []  # reserves waiting for the step in flight to end
        self.num_reserved = 0
        self.num_queued_prefill_tokens = 0  # prompt tokens of prefill jobs queued or active (PrefillWorker)
        self.busy = False
        self.down = False  # a rank loss's recovery (`planner.rank_loss`): no step, reserves wait
        self.pending_loss = None  # a rank loss that waits for the step in flight to end
        self.num_steps = 0
        self.busy_s = 0.0
        self.num_preemptions = 0
        self._num_arrived = 0
        self.num_step_finishing = 0  # prefill: requests whose prompt the step completes
        self.num_step_rows = 0  # decode: requests the step decodes (each streams its tokens)
        self.step_extra_s = 0.0  # decode: host seconds per step beside the model (`ControlPlane`)
        self.admission_step_extra_s = 0.0  # decode: extra seconds of a step that admitted handoffs
        self.finishing_extra_s = 0.0  # prefill: seconds per request the step completes (`ControlPlane`)
        self.step_started_s = self.step_full_s = 0.0  # the step in flight: start, full-speed seconds
        self.step_tail_s = 0.0  # prefill: full-speed seconds of the step after its first tokens are sampled
        self._step: list[tuple[SimRequest, int]] = []
        # DecodeRow is a frozen dataclass (slow to build); rows are plain values, so equal ones are shared
        self._rows: dict[tuple[int, int], DecodeRow] = {}

    def add(self, request: SimRequest) -> None:
        """Queue a prefill job (prefill role)."""
        request.arrival_index = self._next_arrival_index()
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_queued_prefill_tokens += request.num_prompt_tokens

    def reserve(self, request: SimRequest) -> bool:
        """Hold blocks for prompt, first token and k drafts (`RemotePrefills.reserve`); False: no room."""
        num_needed = cdiv(request.num_prompt_tokens + 1 + self.k, self.config.block_size)
        if num_needed > self.num_free_blocks:
            return False
        self.num_free_blocks -= num_needed
        request.num_reserved_blocks = num_needed
        self.num_reserved += 1
        return True

    def handoff_done(self, request: SimRequest) -> None:
        """The prompt KV arrived: admit at the next step boundary."""
        self.pending_admissions.append(request)

    def _admit(self, request: SimRequest, now_s: float) -> None:
        """`Scheduler.admit_reserved`: prompt computed, first token committed, drafts to verify."""
        self.num_reserved -= 1
        request.num_blocks_held, request.num_reserved_blocks = request.num_reserved_blocks, 0
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_output_tokens = 1
        request.admitted_s = request.last_token_s = now_s
        if request.first_token_s is None:  # prefill's reply streams it (`DecodeWorker` admits it textless)
            request.first_token_s = now_s
        if request.max_tokens <= 1:  # the first token finished it
            request.finished_s = now_s
            self._free(request)
            return
        request.num_spec_tokens = min(self.k, request.max_tokens - 2)
        request.arrival_index = self._next_arrival_index()
        self.requests[request.request_id] = request
        self.waiting_for_seat.append(request)

    def _next_arrival_index(self) -> int:
        self._num_arrived += 1
        return self._num_arrived

    @property
    def batch_load(self) -> int:
        """Running, reserved and waiting for a seat (`DecodeNodeLoad.batch_load`)."""
        return (
            len(self.running) + self.num_reserved + len(self.waiting_for_seat) + len(self.pending_admissions)
        )

    def start_step(self, now_s: float) -> float:
        """Admit completed handoffs, plan and price one step; returns its seconds, or 0 when idle."""
        extra_s = self.step_extra_s
        if self.pending_admissions:
            extra_s += self.admission_step_extra_s
            admissions, self.pending_admissions = self.pending_admissions, []
            for request in admissions:
                self._admit(request, now_s)
        num_seats = self.config.max_num_seqs - len(self.running)
        if num_seats > 0 and self.waiting_for_seat:
            self.running.extend(self.waiting_for_seat[:num_seats])
            del self.waiting_for_seat[:num_seats]
        if not self.running and not self.waiting:
            return 0.0
        num_candidates = max(0, self.config.max_num_seqs - len(self.running))
        candidates = sorted(self.waiting, key=_by_arrival)[:num_candidates] if num_candidates else []
        plan = schedule_step(
            self.config,
            # as `Scheduler._running_view`, inlined (one tuple per running request per step: the hot path)
            [
                new_view(
                    RequestView,
                    (
                        r.request_id,
                        r.arrival_index,
                        r.num_computed_tokens,
                        r.num_prompt_tokens + r.num_output_tokens + r.num_spec_tokens - r.num_computed_tokens,
                        r.num_computed_tokens < r.num_prompt_tokens + r.num_output_tokens - 1,
                        r.num_blocks_held,
                        r.num_blocks_held,
                        0,  # num_cached_tokens
                        0,  # num_cached_blocks_evictable
                        0,  # pool: the simulator has one KV pool per instance
                    ),
                )
                for r in self.running
            ],
            [_waiting_view(r) for r in candidates],
            self.num_free_blocks,
        )
        requests = self.requests
        for request_id in plan.preempted_request_ids:
            self._preempt(requests[request_id])
        if plan.admitted:
            admitted = plan.admitted
            for request in candidates:
                if request.request_id in admitted:
                    self.running.append(request)
                    if request.prefill_start_s is None:
                        request.prefill_start_s = now_s
            self.waiting = [r for r in self.waiting if r.request_id not in admitted]
        new_blocks = plan.num_new_blocks
        prefill: list[PrefillChunk] = []
        decode: list[DecodeRow] = []
        step = self._step = []
        is_prefill_role = self.role == "prefill"
        rows = self._rows
        num_taken = finishing = 0
        for request_id, num_new in plan.num_scheduled_tokens.items():
            request = requests[request_id]
            num_blocks = new_blocks[request_id]
            if num_blocks:
                request.num_blocks_held += num_blocks
                num_taken += num_blocks
            step.append((request, num_new))
            num_computed = request.num_computed_tokens
            if is_prefill_role or num_computed < request.num_prompt_tokens + request.num_output_tokens - 1:
                prefill.append(PrefillChunk(num_new, num_computed))
                finishing += is_prefill_role and num_computed + num_new >= request.num_prompt_tokens
            else:
                key = (num_computed, num_new)
                row = rows.get(key)
                if row is None:
                    row = rows[key] = DecodeRow(num_computed, num_new)
                decode.append(row)
        self.num_free_blocks -= num_taken
        self.num_step_finishing, self.num_step_rows = finishing, len(decode)
        if not step:
            return 0.0
        shape = StepShape(tuple(prefill), tuple(decode), self.k)
        model_s = self.model.step_time_s(shape)
        self.step_tail_s = finishing * self.finishing_extra_s
        sampled = getattr(self.model, "first_token_s", None) if finishing else None
        if sampled is not None:  # the MTP pass over the prompts runs after their first tokens are sampled
            self.step_tail_s += model_s - sampled(shape)
        duration_s = model_s + extra_s + finishing * self.finishing_extra_s
        self.step_started_s, self.step_full_s = now_s, duration_s
        self.busy = True
        self.num_steps += 1
        self.busy_s += duration_s
        return duration_s

    def finish_step(self, now_s: float) -> list[SimRequest]:
        """Commit the step ending at `now_s`; returns requests done (prompt done, or max_tokens)."""
        self.busy = False
        done: list[SimRequest] = []
        k, acceptance, draw = self.k, self.acceptance, self.rng.random
        is_decode = self.role == "decode"
        for request, num_new in self._step:
            num_computed = request.num_computed_tokens + num_new
            num_spec = request.num_spec_tokens
            if num_computed < request.num_prompt_tokens + request.num_output_tokens + num_spec:
                request.num_computed_tokens = num_computed
                continue
            if not is_decode:
                request.num_computed_tokens = num_computed
                request.prefill_end_s = now_s
                done.append(request)
                continue
            num_accepted = 0
            if num_spec:
                while num_accepted < num_spec and draw() < acceptance[num_accepted]:
                    num_accepted += 1
                request.num_draft_tokens += num_spec
                request.num_accepted_tokens += num_accepted
                num_computed -= num_spec - num_accepted  # rejected drafts: their KV is recomputed
            request.num_computed_tokens = num_computed
            num_output = request.num_output_tokens + 1 + num_accepted
            request.last_token_s = now_s
            if request.first_token_s is None or request.first_token_s > now_s:
                request.first_token_s = now_s  # a reply slower than this delta: it brings the first token
            num_allowed = request.max_tokens - num_output
            if num_allowed <= 0:
                request.num_output_tokens = request.max_tokens
                request.finished_s = now_s
                done.append(request)
            else:
                request.num_output_tokens = num_output
                request.num_spec_tokens = k if k < num_allowed else num_allowed - 1
        self._step = []
        if done:
            finished = set(done)
            self.running = [r for r in self.running if r not in finished]
            for request in done:
                self._free(request)
                del self.requests[request.request_id]
        return done

    def release_prefill(self, request: SimRequest) -> None:
        """The handoff is over: the request no longer counts as queued prefill work."""
        self.num_queued_prefill_tokens -= request.num_prompt_tokens

    def _preempt(self, request: SimRequest) -> None:
        """Recompute preemption (`Scheduler._preempt`): blocks freed, back to waiting from token 0."""
        self.num_free_blocks += request.num_blocks_held
        request.num_blocks_held = 0
        request.num_computed_tokens = 0
        request.num_spec_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(request)
        self.waiting.append(request)

    def _free(self, request: SimRequest) -> None:
        self.num_free_blocks += request.num_blocks_held
        request.num_blocks_held = 0


def _by_arrival(request: SimRequest) -> int:
    return request.arrival_index


new_view = tuple.__new__  # RequestView is a NamedTuple: tuple.__new__(RequestView, fields) builds one


def _waiting_view(r: SimRequest) -> RequestView:
    num_tokens = r.num_prompt_tokens + r.num_output_tokens
    return RequestView(r.request_id, r.arrival_index, 0, num_tokens - r.num_computed_tokens)
