"""One generation request: its tokens, progress, status, timestamps and speculative-decoding counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdcluster.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_SEAT = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style `finish_reason` ("stop", "length", "abort"; "error" is ours), None while
        unfinished.
        """
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class DraftCounts:
    """MTP drafts of one request proposed / accepted, in all and per draft depth (index 0: the first)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_position: tuple[int, ...] = ()
    num_accepted_tokens_per_position: tuple[int, ...] = ()

    def plus(self, num_draft_tokens: int, num_accepted_tokens: int) -> DraftCounts:
        """One more verification: `num_draft_tokens` drafts, the first `num_accepted_tokens` accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"num_accepted_tokens must be in [0, {num_draft_tokens}], got {num_accepted_tokens}"
            )
        drafted = list(self.num_draft_tokens_per_position)
        accepted = list(self.num_accepted_tokens_per_position)
        for counts, n in ((drafted, num_draft_tokens), (accepted, num_accepted_tokens)):
            counts.extend([0] * (num_draft_tokens - len(counts)))
            for i in range(n):
                counts[i] += 1
        return DraftCounts(
            self.num_draft_tokens + num_draft_tokens,
            self.num_accepted_tokens + num_accepted_tokens,
            tuple(drafted),
            tuple(accepted),
        )

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens, None before any verification."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def summary(self) -> dict[str, Any]:
        drafted, accepted = self.num_draft_tokens_per_position, self.num_accepted_tokens_per_position
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_position": [
                a / d if d else None for a, d in zip(accepted, drafted, strict=False)
            ],
        }


@dataclass(eq=False)
class Request:
    """Mutable state of one request inside one engine instance."""

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
    drafts: DraftCounts = DraftCounts()
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
        """Tokens the next step must run to catch up: `num_tokens + num_output_placeholders +
        len(spec_token_ids) - num_computed_tokens`.
        """
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
