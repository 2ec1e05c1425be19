"""One generation request: its tokens, progress, status, timestamps and speculative-decoding counters.

Token accounting follows vLLM v1's "no prefill phase" model. A request has
`num_tokens = num_prompt_tokens + num_output_tokens` committed tokens, plus `spec_token_ids`: draft tokens
proposed (by MTP) for the next step. `num_computed_tokens` counts the leading tokens whose KV is in the
cache; every step the scheduler lets it catch up with `num_tokens + len(spec_token_ids)`, in one piece
(decode: the last sampled token plus the drafts) or in chunks (prefill, or recompute after preemption).
Between steps a decoding request has `num_computed_tokens == num_tokens - 1`: the token sampled last has
no KV yet.

Asynchronous scheduling (`engine.async_loop`) schedules step N+1 before step N's tokens are committed. A
scheduled step that will sample counts *output placeholders* (`num_output_placeholders`) until its
tokens are committed: the most tokens it can yield, 1 + its drafts. So the scheduler can already run the
next positions (their token ids are filled in by the executor from step N's results). In the synchronous
loop placeholders are always 0 at schedule time.

Only the `Scheduler` (and `engine.request_step`, which it calls per request) mutates a request; the block
manager and the scheduling policy read it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdcluster.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued, holds no KV blocks
    RUNNING = enum.auto()  # in the running batch, holds KV blocks
    PREEMPTED = enum.auto()  # was running, blocks freed; waits to be recomputed from scratch
    # Prefilled on another instance and admitted (prompt KV in its blocks, first token committed): holds
    # its KV blocks and waits for a seat in the running batch (max_num_seqs).
    WAITING_FOR_SEAT = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token, or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens reached
    FINISHED_ABORTED = enum.auto()  # cancelled by the client or the engine
    FINISHED_ERROR = enum.auto()  # failed alone: an error in its own sampling, or in a step that ran it

    # Members are singletons compared by identity: hash them by identity too (C level), instead of
    # Enum's Python-level hash of the name, which the per-step status checks (`is_finished`) pay often.
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style `finish_reason` ("stop", "length", "abort"; "error" is ours), None while
        unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """Mutable state of one request inside one engine instance.

    Attributes:
        request_id: unique within the engine.
        prompt_token_ids: the prompt, >= 1 token.
        sampling_params: sampling and stopping parameters.
        eos_token_id: the model's end-of-sequence token (None: the model has none); ends the request
            unless `sampling_params.ignore_eos`.
        arrival_time_s: when the request reached this engine (clock of the scheduler, seconds).
        status: see `RequestStatus`.
        output_token_ids: committed output tokens (sampled, or accepted drafts).
        num_computed_tokens: leading tokens of `all_token_ids` (then of `spec_token_ids`) whose KV is
            cached. May exceed `num_tokens` while drafts are in flight.
        spec_token_ids: draft tokens to verify in the next step.
        num_output_placeholders: tokens that scheduled, uncommitted sampling steps yield at most (at
            schedule time: 0, or 1 + the drafts of the step in flight; see the module docstring).
        num_cached_tokens: prompt tokens served from the prefix cache when first scheduled (-1: not yet).
        num_preemptions: how many times the request was preempted (recomputed).
        stop_reason: the stop token id that finished the request, if one did.
        first_scheduled_time_s, first_token_time_s, last_token_time_s, finished_time_s: phase
            timestamps (scheduler clock, seconds), None until reached.
        num_draft_tokens, num_accepted_tokens: draft tokens proposed for verification / accepted.
        num_draft_tokens_per_position[i], num_accepted_tokens_per_position[i]: the same, counted per
            draft position i (0 = first draft after the verified token); the acceptance rate at depth i is
            their ratio.
        export_kv: a prefill-only request whose prompt KV, first token and first drafts are handed
            to a decode instance (`LLMEngine.add_request(prefill_only=True)`); set at creation, never changed.
        error: why the request failed (status FINISHED_ERROR), else None.
        kv_pool: the KV block pool (precision) it was admitted to (`engine.kv_pools`); 0 with one pool.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    arrival_time_s: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | None = None
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None
    finished_time_s: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_position: list[int] = field(default_factory=list)
    num_accepted_tokens_per_position: list[int] = field(default_factory=list)
    export_kv: bool = False
    error: str | None = None
    kv_pool: int = 0

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"prompt_token_ids of request {self.request_id!r} is empty")
        self.prompt_token_ids = list(self.prompt_token_ids)
        # prompt + output in one list, so slicing token windows (hashing, model inputs) costs no concat.
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (read-only view; do not mutate)."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Committed tokens: prompt + output."""
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens the next step must run to catch up:
        `num_tokens + num_output_placeholders + len(spec_token_ids) - num_computed_tokens`."""
        return self.num_tokens_with_spec + self.num_output_placeholders - self.num_computed_tokens

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most output tokens the request may produce."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def record_spec_result(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verification of `num_draft_tokens` drafts of which the first `num_accepted_tokens`
        were accepted (0 <= accepted <= drafts)."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"num_accepted_tokens must be in [0, {num_draft_tokens}], got {num_accepted_tokens}"
            )
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        # Both lists grow to the deepest draft position seen, so they always have equal lengths.
        for counts, n in (
            (self.num_draft_tokens_per_position, num_draft_tokens),
            (self.num_accepted_tokens_per_position, num_accepted_tokens),
        ):
            counts.extend([0] * (num_draft_tokens - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens, None before any verification."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def queue_time_s(self) -> float | None:
        """Arrival to first scheduling."""
        if self.first_scheduled_time_s is None:
            return None
        return self.first_scheduled_time_s - self.arrival_time_s

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to the first committed output token."""
        if self.first_token_time_s is None:
            return None
        return self.first_token_time_s - self.arrival_time_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: mean gap, None with fewer than two output tokens."""
        if self.first_token_time_s is None or self.last_token_time_s is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time_s - self.first_token_time_s) / (self.num_output_tokens - 1)
