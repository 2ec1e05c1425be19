"""The traces of `bench.pd_autoscale`: Azure conversation rows split into prompt-heavy and output-heavy,
their arrival rates priced by the perf model (`Pricing`), `phase_shift` and `steady` built from them."""

from __future__ import annotations

import dataclasses
import random
import statistics

HOT_INSTANCES_FRACTION = 0.6  # of a phase's hot pool: 2.4 of 4 instances
STEADY_LOAD = 0.7  # of all instances' capacity
MAX_OUTPUT_TOKENS = 384  # outputs capped (and at half the model's context)


class Pricing:
    """Instance-seconds a request costs each pool, from the perf model (`capacity_from_models`)."""

    def __init__(self, topology, prefill_model, decode_model, acceptance, control_plane=None) -> None:  # noqa: ANN001
        self.args = (topology, prefill_model, decode_model, acceptance)
        self.topology, self.decode_model, self.control_plane = topology, decode_model, control_plane
        self.tpot_slo_s = (topology.slo.tpot_ms or 100.0) / 1000

    def host_s(self, num_output: float) -> float:
        """Core-seconds the driver spends on a request (`ControlPlane.host_cpu_*`; 0 without one)."""
        from pdcluster.driver.autoscale_capacity import tokens_per_step

        cp = self.control_plane
        if cp is None:
            return 0.0
        steps = num_output / tokens_per_step(self.args[3][: self.topology.decode.num_speculative_tokens])
        return cp.host_cpu_per_request_s + cp.host_cpu_per_decode_step_s * steps

    def per_request_s(self, num_input: float, num_output: float) -> tuple[float, float]:
        from pdcluster.driver.autoscale_capacity import capacity_from_models, tokens_per_step
        from pdcluster.planner.step_model import DecodeRow, StepShape

        context = int(num_input + num_output / 2)
        cap = capacity_from_models(*self.args, self.tpot_slo_s, context, int(num_input))
        k = self.topology.decode.num_speculative_tokens
        batch = int(cap.decode_batch)
        step_s = self.decode_model.step_time_s(StepShape((), (DecodeRow(context, 1 + k),) * batch, k))
        decode_tokens_per_s = batch * tokens_per_step(self.args[3][:k]) / step_s
        return num_input / cap.prefill_tokens_per_s, num_output / decode_tokens_per_s


def azure_rows(max_model_len: int, max_output: int, input_scale: float) -> tuple[list, list[float]]:
    """Azure conversation rows (inputs x `input_scale`, clamped to the model; outputs capped), and the
    trace's arrival gaps in seconds."""
    from pdcluster.planner.trace import MIN_INPUT_TOKENS, TraceRequest, load_trace

    trace = load_trace("AzureLLMInferenceTrace_conv.csv").requests
    max_input = max_model_len - max_output
    rows = [
        TraceRequest(
            0.0,
            min(max_input, max(MIN_INPUT_TOKENS, round(r.num_input_tokens * input_scale))),
            min(max_output, max(1, r.num_output_tokens)),
        )
        for r in trace
    ]
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:], strict=False)]
    return rows, gaps


def _arrivals(rows: list, gaps: list[float], rate: float, start_s: float, duration_s: float, rng) -> list:  # noqa: ANN001
    """`rows` in a seeded order from `start_s` for `duration_s`: a run of consecutive Azure gaps from a seeded
    point, scaled so that their own mean is 1 / `rate` (the trace's rate drifts: its global mean would not
    give `rate` over a short run)."""
    num = max(1, round(rate * duration_s))
    first = rng.randrange(len(gaps))
    run = [gaps[(first + i) % len(gaps)] for i in range(num)]
    scale = statistics.fmean(run) * rate
    order = rows[:]
    rng.shuffle(order)
    out, now_s = [], start_s
    for i, gap in enumerate(run):
        now_s += gap / scale
        if now_s >= start_s + duration_s:
            break
        out.append(dataclasses.replace(order[i % len(order)], arrival_s=now_s))
    return out


def build_traces(
    topology,  # noqa: ANN001
    pricing: Pricing,
    phase_s: float,
    seed: int,
    cores: float | None = None,
    load: float = 1.0,
    max_output: int = MAX_OUTPUT_TOKENS,
) -> dict[str, list]:
    """`phase_shift` and `steady` (`bench.pd_autoscale`'s docstring); with `cores` (instances sharing a CPU
    node's cores) the rates are sized to min(instances, cores the control plane's background leaves)
    instances, the driver's CPU per request counted with the hot pool's, times `load`."""
    from pdcluster.planner.sizing import pool_sizing

    max_model_len = pool_sizing(topology, "decode").scheduler.max_model_len
    max_output = min(max_output, max_model_len // 2)
    rows, gaps = azure_rows(max_model_len, max_output, min(1.0, max_model_len / 4096))
    inputs = sorted(r.num_input_tokens for r in rows)
    outputs = sorted(r.num_output_tokens for r in rows)
    q = len(rows) // 4
    prompt_heavy = [
        r for r in rows if r.num_input_tokens >= inputs[3 * q] and r.num_output_tokens <= outputs[q]
    ]
    output_heavy = [
        r for r in rows if r.num_input_tokens <= inputs[q] and r.num_output_tokens >= outputs[3 * q]
    ]
    total = topology.prefill.num_instances + topology.decode.num_instances
    sized, host = total * load, 0.0
    if cores is not None:  # the cores the control plane's background leaves, at least a quarter
        cp = pricing.control_plane
        free = max(cores - (cp.background_cores if cp is not None else 0.0), cores / 4)
        sized, host = min(total, free) * load, 1.0
    rng = random.Random(seed)

    def mean_cost(subset: list) -> tuple[float, float, float]:
        num_output = statistics.fmean(r.num_output_tokens for r in subset)
        prefill_s, decode_s = pricing.per_request_s(
            statistics.fmean(r.num_input_tokens for r in subset), num_output
        )
        return prefill_s, decode_s, host * pricing.host_s(num_output)

    hot = HOT_INSTANCES_FRACTION * sized
    prompt_rate = hot / (mean_cost(prompt_heavy)[0] + mean_cost(prompt_heavy)[2])
    output_rate = hot / (mean_cost(output_heavy)[1] + mean_cost(output_heavy)[2])
    phase_shift = []
    for i, (subset, rate) in enumerate(
        ((prompt_heavy, prompt_rate), (output_heavy, output_rate), (prompt_heavy, prompt_rate))
    ):
        phase_shift += _arrivals(subset, gaps, rate, i * phase_s, phase_s, rng)
    steady_rate = STEADY_LOAD * sized / sum(mean_cost(rows))
    steady = _arrivals(rows, gaps, steady_rate, 0.0, 3 * phase_s, rng)
    return {"phase_shift": phase_shift, "steady": steady}


def thinned(requests: list, max_requests: int | None) -> list:
    """At most `max_requests` of `requests`, evenly spaced in arrival order (a lower load); all for None."""
    if max_requests is None or len(requests) <= max_requests:
        return requests
    return [requests[i * len(requests) // max_requests] for i in range(max_requests)]
