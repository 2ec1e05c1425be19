"""One instance's capacity for the dynamic P:D controller (`driver.autoscale.Capacity`), priced by the
planner's step-time model (`planner.step_model.StepTimeModel`: `planner.perf_model`, or a calibration)."""

from __future__ import annotations

from collections.abc import Sequence

from pdcluster.config import Topology
from pdcluster.driver.autoscale import Capacity
from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape, StepTimeModel


def tokens_per_step(acceptance_per_position: Sequence[float]) -> float:
    """Expected tokens a decode step emits: 1 + sum over i of prod(acceptance[:i+1])."""
    total, prob = 1.0, 1.0
    for a in acceptance_per_position:
        prob *= a
        total += prob
    return total


def capacity_from_models(
    topology: Topology,
    prefill_model: StepTimeModel,
    decode_model: StepTimeModel,
    acceptance_per_position: Sequence[float],
    tpot_slo_s: float,
    context_len: int,
    prompt_len: int,
) -> Capacity:
    """One instance's capacity priced by the perf model: prompt tokens/s of a prefill step filled with
    `prompt_len`-token prompts (`max_num_batched_tokens`), and the largest decode batch (<= max_num_seqs,
    >= 1) whose step at `context_len` emits tokens within the TPOT SLO, and the output tokens/s it emits."""
    budget = topology.prefill.max_num_batched_tokens
    chunk = max(1, min(prompt_len, budget))
    chunks = (PrefillChunk(chunk),) * max(1, budget // chunk)
    num_tokens = chunk * len(chunks)
    prefill_s = prefill_model.step_time_s(StepShape(chunks, (), 0))
    k = topology.decode.num_speculative_tokens
    per_step = tokens_per_step(acceptance_per_position[:k])

    def tpot_s(batch: int) -> float:
        rows = (DecodeRow(max(context_len, 1), 1 + k),) * batch
        return decode_model.step_time_s(StepShape((), rows, k)) / per_step

    low, high = 1, topology.decode.max_num_seqs
    while low < high:  # step time grows with the batch: the largest batch within the SLO
        mid = (low + high + 1) // 2
        low, high = (mid, high) if tpot_s(mid) <= tpot_slo_s else (low, mid - 1)
    return Capacity(num_tokens / prefill_s, float(low), low / tpot_s(low))
