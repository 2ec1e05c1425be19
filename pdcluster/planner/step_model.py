"""What the simulator asks of a performance model: the duration of one engine step, and of one KV handoff.

This is the seam between `planner.perf_model` (FLOPs and bytes per op on a hardware catalog entry, a
roofline, calibrated here by `pdcluster profile`) and `planner.simulator` (a discrete-event loop over a
trace that calls the live router, dispatch and scheduler policies). Plain data only, no torch.

A step is what the live scheduler (`engine.scheduler_policy.schedule_step`) plans for one instance: some
prefill chunks and some decode rows. One instance's step runs on all its ranks (DP attention, EP MoE);
the model prices the step of the slowest rank, so EP imbalance is the model's business, not the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PrefillChunk:
    """One request's prefill work in a step.

    Attributes:
        num_tokens: prompt tokens computed in this step (the chunk), >= 1.
        context_len: prompt tokens already in the KV cache before this chunk (prefix hit or earlier
            chunks), >= 0. Attention of the chunk reads `context_len + num_tokens` positions.
    """

    num_tokens: int
    context_len: int = 0


@dataclass(frozen=True)
class DecodeRow:
    """One running request's decode work in a step.

    Attributes:
        context_len: tokens in its KV cache before this step (prompt + output so far), >= 1.
        num_query_tokens: tokens verified in this step: 1 + the drafts scheduled (k with MTP k), >= 1.
    """

    context_len: int
    num_query_tokens: int = 1


@dataclass(frozen=True)
class StepShape:
    """One engine step of one instance.

    Attributes:
        prefill: the prefill chunks of the step.
        decode: the decode rows of the step.
        num_speculative_tokens: MTP draft tokens proposed per decode row after the verify (the MTP
            layer's forwards, k chained), 0 without speculative decoding.
    """

    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[DecodeRow, ...] = ()
    num_speculative_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the main model computes in this step."""
        return sum(c.num_tokens for c in self.prefill) + sum(r.num_query_tokens for r in self.decode)


class StepTimeModel(Protocol):
    """Seconds of one engine step and of one P→D KV handoff, for one instance of one pool."""

    def step_time_s(self, step: StepShape) -> float:
        """Wall seconds of `step` on this instance (slowest rank), host overhead included. > 0 unless
        the step is empty, where it is 0."""
        ...

    def kv_handoff_s(self, num_prompt_tokens: int, prefill_compute_s: float) -> float:
        """Seconds from the end of the last prefill step of a request until its KV cache is admitted on
        the decode instance: with layer-wise streaming, what the transfer adds after `prefill_compute_s`
        of compute it overlapped with (at least one layer's transfer and the fixed per-handoff cost)."""
        ...
