"""The planner's workload: a trace loaded, repeated to the requested size and set to a rate."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pdcluster.planner.trace import (
    MIN_INPUT_TOKENS,
    REFERENCE_CONTEXT_TOKENS,
    Trace,
    Workload,
    arrival_rate_per_s,
    load_trace,
    scale_trace,
)


def repeat_trace(trace: Trace, num_requests: int) -> Trace:
    """The trace repeated to `num_requests`, each repetition one mean gap after the last (the rate kept).
    Raises ValueError for an empty trace or num_requests < 1."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    requests = trace.requests
    if not requests:
        raise ValueError(f"{trace.path}: the trace has no requests")
    if num_requests <= len(requests):
        return replace(trace, requests=requests[:num_requests])
    rate = arrival_rate_per_s(requests)
    span_s = requests[-1].arrival_s - requests[0].arrival_s + (1 / rate if rate > 0 else 1.0)
    out = []
    for i in range(num_requests):
        copy, j = divmod(i, len(requests))
        out.append(replace(requests[j], arrival_s=requests[j].arrival_s + copy * span_s))
    return replace(trace, requests=out)


def plan_workload(
    trace_path: str | Path,
    max_model_len: int,
    num_requests: int | None = None,
    rate_per_s: float | None = None,
    max_tokens_cap: int = 128,
    scale_to_context: int | None = None,
) -> Workload:
    """Load `trace_path` (bare names from ../shared/traces), repeat it to `num_requests`, set its mean rate;
    input lengths clamped to the model, outputs to `max_tokens_cap`. Raises FileNotFoundError or ValueError.
    """
    trace = load_trace(trace_path, num_requests)
    if num_requests is not None:
        trace = repeat_trace(trace, num_requests)
    time_scale = 1.0
    if rate_per_s is not None:
        if not rate_per_s > 0:
            raise ValueError(f"the request rate must be > 0, got {rate_per_s}")
        native = arrival_rate_per_s(trace.requests)
        if native <= 0:
            raise ValueError(f"{trace.path}: fewer than two distinct arrival times, no rate to scale")
        time_scale = rate_per_s / native
    if scale_to_context is not None and not 0 < scale_to_context <= max_model_len:
        raise ValueError(
            f"the context to scale to must be in [1, max_model_len {max_model_len}], got {scale_to_context}"
        )
    reference = max_model_len if scale_to_context is None else REFERENCE_CONTEXT_TOKENS[trace.kind]
    workload = scale_trace(
        trace,
        scale_to_context or max_model_len,
        max_tokens_cap=max_tokens_cap,
        time_scale=time_scale,
        reference_context_tokens=reference,
    )
    if scale_to_context is not None:
        return workload
    max_input = max_model_len - max_tokens_cap
    num_long = sum(r.num_input_tokens > max_input for r in trace.requests)
    num_short = sum(r.num_input_tokens < MIN_INPUT_TOKENS for r in trace.requests)
    num_capped = sum(r.num_output_tokens > max_tokens_cap for r in trace.requests)
    description = (
        f"{trace.kind} trace {trace.path.name}, {len(workload.requests)} requests at their recorded lengths: "
        f"{num_long} inputs clamped to {max_input} tokens (max_model_len {max_model_len} - max_tokens_cap "
        f"{max_tokens_cap}), {num_short} raised to {MIN_INPUT_TOKENS}; {num_capped} outputs capped at "
        f"{max_tokens_cap}; arrival times / {time_scale:g}"
    )
    return replace(workload, description=description)
