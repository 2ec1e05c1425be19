"""The planner's workload: a trace loaded, repeated to the requested size, scaled and set to a rate.

`orchestrator.trace.scale_trace` does the scaling (input lengths to the model's context, output lengths
capped, arrival times compressed), exactly as `pdcluster bench` replays the trace live.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pdcluster.orchestrator.trace import Trace, Workload, arrival_rate_per_s, load_trace, scale_trace


def repeat_trace(trace: Trace, num_requests: int) -> Trace:
    """The trace's requests repeated until there are `num_requests`: each repetition starts one mean
    inter-arrival gap after the previous one ends, so the arrival rate stays the trace's.

    Raises:
        ValueError: an empty trace or num_requests < 1.
    """
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
    context_len: int | None = None,
) -> Workload:
    """Load `trace_path` (a bare name is looked up in ../shared/traces), repeat it to `num_requests`
    (default: the trace as it is), scale it to `max_model_len` and, with `rate_per_s`, compress or stretch
    its arrival times to that mean rate (requests per second). `context_len` (at most `max_model_len`):
    scale the lengths to that context instead (8192 keeps the Azure trace's own lengths).

    Raises:
        FileNotFoundError, ValueError: a bad trace or option.
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
    if context_len is not None and not 0 < context_len <= max_model_len:
        raise ValueError(
            f"the context length must be in [1, max_model_len {max_model_len}], got {context_len}"
        )
    return scale_trace(
        trace, context_len or max_model_len, max_tokens_cap=max_tokens_cap, time_scale=time_scale
    )
