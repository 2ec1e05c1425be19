"""A simulation's outcome (`SimResult`), its requests measured as the live benchmark client does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.config.slo import time_per_output_token_s
from pdcluster.entrypoints.bench_client import RequestResult, format_table
from pdcluster.planner.sim_engine import SimRequest


@dataclass
class SimResult:
    """One simulation's outcome: results in trace order, duration_s, summary, per-pool counters."""

    results: list[RequestResult]
    duration_s: float
    summary: dict
    num_steps: dict[str, int] = field(default_factory=dict)
    busy_fraction: dict[str, float] = field(default_factory=dict)
    num_preemptions: dict[str, int] = field(default_factory=dict)
    num_events: int = 0
    rank_losses: list[dict] = field(default_factory=list)

    def as_table(self, description: str = "") -> str:
        return format_table(self.summary, description, simulated=True)


def to_results(sims: Sequence[SimRequest]) -> tuple[list[RequestResult], float]:
    """`RequestResult`s and the duration (first arrival -> last answer) in seconds, as `bench_client.replay`
    measures them; phases queue_s, prefill_s, kv_transfer_s, decode_s add up to e2e."""
    results = []
    first_s = min((s.arrival_s for s in sims), default=0.0)
    last_s = first_s
    for s in sims:
        kept = s.num_kept_tokens  # streamed before a rank loss, prefilled again as prompt
        result = RequestResult(
            s.index, s.num_prompt_tokens - kept, s.max_tokens + kept, s.arrival_s - first_s
        )
        if s.finished_s is None or s.first_token_s is None:
            result.error = s.error or "not finished when the simulation ended"
            results.append(result)
            continue
        assert s.prefill_start_s is not None and s.prefill_end_s is not None and s.last_token_s is not None
        assert s.admitted_s is not None
        result.ok = True
        result.num_output_tokens = s.num_output_tokens + kept
        result.ttft_s = s.first_token_s - s.arrival_s
        result.tpot_s = time_per_output_token_s(s.first_token_s, s.last_token_s, result.num_output_tokens)
        result.e2e_s = s.finished_s - s.arrival_s
        if s.num_draft_tokens:
            result.acceptance_rate = s.num_accepted_tokens / s.num_draft_tokens
        result.kv_transfer_s = s.admitted_s - s.prefill_end_s
        result.phases = {
            "queue_s": s.prefill_start_s - s.arrival_s,
            "prefill_s": s.prefill_end_s - s.prefill_start_s,
            "kv_transfer_s": result.kv_transfer_s,
            "decode_s": s.last_token_s - s.admitted_s,
        }
        last_s = max(last_s, s.finished_s)
        results.append(result)
    return results, last_s - first_s
