"""Seconds the live control-plane and handoff path adds around engine steps, and its measurement.

`measure_control_plane` runs requests one at a time on the live cluster (no queueing, so every difference
is overhead) and takes, per field of `ControlPlane`, the median of measured minus modelled seconds:
dispatch_s (route + reserve), first_token_extra_s (TTFT - dispatch - prefill step), handoff_extra_s
(kv_transfer + admit - prefill step - KV handoff), first_decode_step_extra_s and decode_step_extra_s
(measured decode steps - modelled step). Clamped at 0; measured at batch 1 only. The driver process's own
CPU seconds per probe (route, Ray calls, streaming; with `pdcluster bench`'s client in it) are fitted as
`host_cpu_per_request_s + host_cpu_per_decode_step_s x decode steps` (least squares over probes of two
output lengths): on `cpu` they compete with the engines for the node's cores (`planner.core_sharing`).
The rest of the node's load is `background_cores`: the prefill rank's median share of a core while its probe
step ran (1 - run-queue wait / prefill time, `workers.thread_clock`) is `cores / (1 + background)` under
processor sharing; the modelled engine times above are divided by that share before the subtractions, so
the extras hold only what the engines' slowdown does not.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape, StepTimeModel

PROMPT_LENS = (16, 48, 128, 320)  # the local traces' prompts after scaling: median ~50, p90 ~300
DEFAULT_REQUESTS, QUICK_REQUESTS = 12, 4
DEFAULT_MAX_TOKENS, QUICK_MAX_TOKENS = 24, 12
MIN_DECODE_STEPS = 4  # a per-step figure from fewer steps is mostly the first step's and the stream's noise


@dataclass(frozen=True)
class ControlPlane:
    """Seconds the live path adds around the engine steps; all >= 0, zero by default (engine-side only)."""

    dispatch_s: float = 0.0
    first_token_extra_s: float = 0.0
    handoff_extra_s: float = 0.0
    first_decode_step_extra_s: float = 0.0
    decode_step_extra_s: float = 0.0
    host_cpu_per_request_s: float = 0.0
    host_cpu_per_decode_step_s: float = 0.0
    background_cores: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0:  # fmt: skip
                raise ValueError(f"ControlPlane.{f.name} must be a finite number >= 0, got {value!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def control_plane_from_calibration(path: str | Path | None) -> ControlPlane:
    """The `control_plane` of a calibration JSON; zero when `path` is None or it has none. Raises ValueError
    as `read_calibration`, or for a key or value `ControlPlane` refuses."""
    if path is None:
        return ControlPlane()
    from pdcluster.planner.calibration import read_calibration

    raw = read_calibration(path).get("control_plane")
    if raw is None:
        return ControlPlane()
    known = {f.name for f in fields(ControlPlane)}
    values = raw.get("values") if isinstance(raw, dict) else None
    if not isinstance(values, dict) or set(values) - known:
        raise ValueError(f"{path}: control_plane.values must be an object with keys among {sorted(known)}")
    return ControlPlane(**values)


def _modelled(prefill: StepTimeModel, decode: StepTimeModel, prompt_len: int, k: int) -> dict[str, float]:
    prefill_s = prefill.step_time_s(StepShape(prefill=(PrefillChunk(prompt_len),), num_speculative_tokens=k))
    decode_s = decode.step_time_s(
        StepShape(decode=(DecodeRow(prompt_len + 2, 1 + k),), num_speculative_tokens=k)
    )
    return {
        "prefill_s": prefill_s,
        "kv_handoff_s": prefill.kv_handoff_s(prompt_len, prefill_s),
        "decode_s": decode_s,
    }


def derive(points: list[dict[str, Any]], background_cores: float = 0.0) -> ControlPlane:
    """`ControlPlane` from the per-request points of `measure_control_plane`."""
    if not points:
        raise ValueError("no measured request: cannot derive the control plane")

    def med(key: str) -> float:
        values = [p[key] for p in points if p.get(key) is not None]
        return max(0.0, statistics.median(values)) if values else 0.0

    host = [(p["num_decode_steps"], p["host_cpu_s"]) for p in points if p.get("host_cpu_s") is not None]
    per_request, per_step = _line(host)
    return ControlPlane(
        **{f.name: med(f.name) for f in fields(ControlPlane) if f.name.startswith(_MEDIANS)},
        background_cores=background_cores,
        host_cpu_per_request_s=per_request,
        host_cpu_per_decode_step_s=per_step,
    )


_MEDIANS = ("dispatch", "first_", "handoff", "decode")


def cpu_share(results: list) -> float:
    """Median over `results` of the prefill rank's share of a core while its step ran (1 when unreported)."""
    shares = [
        1.0 - r.phases["prefill_cpu_wait_s"] / r.phases["prefill_s"]
        for r in results
        if r.phases.get("prefill_cpu_wait_s") is not None and (r.phases.get("prefill_s") or 0) > 0
    ]
    return min(1.0, max(statistics.median(shares), 0.05)) if shares else 1.0


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """`(a, b)` >= 0 of the least-squares `y = a + b x` (b = 0 when x does not vary: a is the mean)."""
    if not points:
        return 0.0, 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b


def point_from_result(result, k: int, modelled: dict[str, float]) -> dict[str, Any]:
    """One request's measured pieces (seconds) from its `RequestResult`."""
    ph = result.phases
    dispatch = (ph.get("route_s") or 0.0) + (ph.get("reserve_s") or 0.0)
    point: dict[str, Any] = {
        "num_prompt_tokens": result.num_input_tokens,
        "num_output_tokens": result.num_output_tokens,
        "ttft_s": result.ttft_s,
        "tpot_s": result.tpot_s,
        "phases": dict(ph),
        "modelled": modelled,
        "dispatch_s": dispatch,
    }
    point["first_token_extra_s"] = result.ttft_s - dispatch - modelled["prefill_s"]
    kv_transfer, admit = ph.get("kv_transfer_s"), ph.get("admit_s") or 0.0
    gap = 0.0
    if kv_transfer is not None:
        point["handoff_extra_s"] = kv_transfer + admit - modelled["prefill_s"] - modelled["kv_handoff_s"]
        gap = max(0.0, dispatch + kv_transfer + admit - result.ttft_s)
    first = ph.get("first_decode_step_s")
    if first is not None:
        point["first_decode_step_extra_s"] = first - modelled["decode_s"]
    tokens_per_step = 1.0 + (result.acceptance_rate or 0.0) * k
    num_steps = (result.num_output_tokens - 1) / tokens_per_step
    point["num_decode_steps"] = num_steps
    if first is not None and result.tpot_s is not None and num_steps >= MIN_DECODE_STEPS:
        decode_time = result.tpot_s * (result.num_output_tokens - 1) - gap
        point["decode_step_extra_s"] = (decode_time - first) / (num_steps - 1) - modelled["decode_s"]
    return point


def measure_control_plane(
    topology, prefill: StepTimeModel, decode: StepTimeModel, num_requests: int, max_tokens: int,
    progress: Callable[[str], None] = lambda label: None,
) -> dict[str, Any]:  # fmt: skip
    """Deploy `topology` here and `probe_control_plane` it. Raises as `probe_control_plane` and `serve`."""
    from pdcluster.entrypoints.serve import serve

    with serve(topology, port=0, log=lambda message: None) as service:
        return probe_control_plane(service.url, topology, prefill, decode, num_requests, max_tokens, progress)


def probe_control_plane(
    url: str, topology, prefill: StepTimeModel, decode: StepTimeModel, num_requests: int, max_tokens: int,
    progress: Callable[[str], None] = lambda label: None,
) -> dict[str, Any]:  # fmt: skip
    """Send `num_requests` requests one at a time to the server at `url` (serving `topology`, driven from
    this process), every other one with a quarter of `max_tokens`, and derive the `ControlPlane`.

    Returns `{"values", "points", "num_failed"}`. Raises ValueError when no request succeeded.
    """
    from pdcluster.entrypoints.bench_client import replay, served_model
    from pdcluster.models.tokenizer import Tokenizer
    from pdcluster.planner.trace import TraceRequest, Workload, build_prompts

    k = topology.decode.num_speculative_tokens
    tokenizer = Tokenizer.from_dir(topology.engine_config("decode").model)
    lengths = [PROMPT_LENS[i % len(PROMPT_LENS)] for i in range(num_requests + 1)]
    outputs = [max_tokens if i % 2 else max(2, max_tokens // 4) for i in range(num_requests + 1)]
    # consecutive held-out slices: distinct prompts, so no prefix hit shortens a prefill priced in full
    every = Workload(
        [TraceRequest(0.0, n, m) for n, m in zip(lengths, outputs, strict=True)],
        "control-plane probes",
        "azure",
        1.0,
    )
    prompts = build_prompts(every, tokenizer)
    measured, failed = [], 0
    model, _ = served_model(url)
    for i, prompt_len in enumerate(lengths):  # the first warms the path, untimed
        one = Workload([every.requests[i]], every.description, every.kind, every.input_scale)
        cpu_s = time.process_time()
        (result,), _ = asyncio.run(replay(url, one, [prompts[i]], model=model, show_progress=False))
        cpu_s = time.process_time() - cpu_s
        if i == 0:
            continue
        if not result.ok or result.ttft_s is None:
            failed += 1
            continue
        measured.append((result, prompt_len, cpu_s))
        progress(f"control plane {i}/{num_requests}")
    if not measured:
        raise ValueError(f"none of {num_requests} control-plane probes succeeded")
    share = cpu_share([result for result, _, _ in measured])
    points = []
    for result, prompt_len, cpu_s in measured:
        modelled = {key: s / share for key, s in _modelled(prefill, decode, prompt_len, k).items()}
        points.append({**point_from_result(result, k, modelled), "host_cpu_s": cpu_s, "cpu_share": share})
    background = max(0.0, (os.cpu_count() or 1) / share - 1.0) if share < 1 else 0.0
    return {"values": derive(points, background).to_dict(), "points": points, "num_failed": failed}
