"""What the simulator asks of a performance model: seconds of one engine step and of one KV handoff.

The seam between `planner.perf_model` and `planner.simulator`; plain data, no torch. A step is what
`schedule_step` plans for one instance; the model prices its slowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PrefillChunk:
    """One request's prefill work in a step: `num_tokens` (>= 1) computed over `context_len` (>= 0) cached."""

    num_tokens: int
    context_len: int = 0


@dataclass(frozen=True)
class DecodeRow:
    """One running request's decode work: `context_len` (>= 1) cached, 1 + drafts verified."""

    context_len: int
    num_query_tokens: int = 1


@dataclass(frozen=True)
class StepShape:
    """One engine step of one instance; `num_speculative_tokens`: MTP drafts per decode row."""

    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[DecodeRow, ...] = ()
    num_speculative_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the main model computes in this step."""
        return sum(c.num_tokens for c in self.prefill) + sum(r.num_query_tokens for r in self.decode)


class StepTimeModel(Protocol):
    """Seconds of one engine step and of one P->D KV handoff, for one instance of one pool."""

    def step_time_s(self, step: StepShape) -> float:
        """Wall seconds of `step` on this instance (slowest rank, host included); 0 if empty."""
        ...

    def kv_handoff_s(self, num_prompt_tokens: int, prefill_compute_s: float) -> float:
        """Seconds from a request's last prefill step until decode admits its KV."""
        ...
