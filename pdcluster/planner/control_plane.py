"""Seconds the live control-plane and handoff path adds around engine steps, and its measurement.

`probe_control_plane` runs requests one at a time on the live cluster (no queueing), each as the previous
ends, then some after an idle pause; `derive_from_probes` takes per `ControlPlane` field the median of
measured minus modelled seconds of the former (clamped at 0; the per-step extra pooled over all their
steps), the first-token excess of the latter over them,
and fits the driver's CPU per probe as `host_cpu_per_request_s + host_cpu_per_decode_step_s x decode steps`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape, StepTimeModel

PROMPT_LENS = (16, 48, 128, 192, 320)  # five: every other probe is long, so each length gets both
DEFAULT_REQUESTS, QUICK_REQUESTS = 12, 4
DEFAULT_MAX_TOKENS, QUICK_MAX_TOKENS = 24, 12
IDLE_WINDOW_S = 3.0  # long enough for several of the cluster's periodic polls
MIN_DECODE_STEPS = 4  # a per-step figure from fewer steps is mostly the first step's and the stream's noise
IDLE_PAUSE_S = 1.0  # before each idle probe: the gap a low-rate trace leaves between requests


@dataclass(frozen=True)
class ControlPlane:
    """Seconds the live path adds around the engine steps (>= 0; zero: engine-side only). `prefill_extra_s`:
    a prefill instance busy per request after its first token (last KV, MTP pass, reply) at full speed;
    `first_token_extra_s`: sampling to the client; `idle_first_token_extra_s`: more for a request that
    finds no other in flight (the path woken from idle). Cores: `background_cores` busy all the time,
    `prefill_corunner_cores` only while a prefill step runs (`derive_from_probes`)."""

    dispatch_s: float = 0.0
    prefill_extra_s: float = 0.0
    first_token_extra_s: float = 0.0
    idle_first_token_extra_s: float = 0.0
    handoff_extra_s: float = 0.0
    first_decode_step_extra_s: float = 0.0
    decode_step_extra_s: float = 0.0
    host_cpu_per_request_s: float = 0.0
    host_cpu_per_decode_step_s: float = 0.0
    background_cores: float = 0.0
    prefill_corunner_cores: float = 0.0

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
    """Full-speed modelled seconds of a lone probe's prefill step, of that step up to its first token
    (`sampled_s`) and of a decode step."""
    step = StepShape(prefill=(PrefillChunk(prompt_len),), num_speculative_tokens=k)
    prefill_s = prefill.step_time_s(step)
    sampled = getattr(prefill, "first_token_s", None)
    decode_s = decode.step_time_s(
        StepShape(decode=(DecodeRow(prompt_len + 2, 1 + k),), num_speculative_tokens=k)
    )
    return {"prefill_s": prefill_s, "sampled_s": prefill_s if sampled is None else sampled(step),
            "decode_s": decode_s}  # fmt: skip


def derive(
    points: list[dict[str, Any]],
    background_cores: float = 0.0,
    host_line: tuple[float, float] | None = None,
    prefill_corunner_cores: float = 0.0,
) -> ControlPlane:
    """`ControlPlane` from per-request points (`point_from_result`): the median of each extra (the first
    decode step's net of the per-step one, which the simulator adds to every step) but the per-step one,
    pooled over the points' `later_steps` (measured minus modelled seconds over their steps); the driver's
    CPU line `host_line`, else fitted on the points' `host_cpu_s`."""
    if not points:
        raise ValueError("no measured request: cannot derive the control plane")

    def med(key: str) -> float:
        values = [p[key] for p in points if p.get(key) is not None]
        return max(0.0, statistics.median(values)) if values else 0.0

    if host_line is None:
        host_line = _line(
            [(p["num_decode_steps"], p["host_cpu_s"]) for p in points if p.get("host_cpu_s") is not None]
        )
    values = {f.name: med(f.name) for f in fields(ControlPlane) if f.name.startswith(_MEDIANS)}
    later = [p["later_steps"] for p in points if p.get("later_steps", (0,))[0] >= MIN_DECODE_STEPS - 1]
    if later:  # pooled: all their seconds over all their steps (the per-probe figures' median otherwise)
        pooled_s = sum(s - m for _, s, m in later) / sum(n for n, _, _ in later)
        values["decode_step_extra_s"] = max(0.0, pooled_s)
    values["first_decode_step_extra_s"] = max(
        0.0, values["first_decode_step_extra_s"] - values["decode_step_extra_s"]
    )
    return ControlPlane(
        **values,
        background_cores=background_cores,
        prefill_corunner_cores=prefill_corunner_cores,
        host_cpu_per_request_s=host_line[0],
        host_cpu_per_decode_step_s=host_line[1],
    )


_MEDIANS = ("dispatch", "prefill_extra", "first_", "handoff", "decode")


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


def num_decode_steps(result, k: int) -> float:
    """Decode steps after the first token: (output tokens - 1) / (1 + acceptance x k)."""
    return (result.num_output_tokens - 1) / (1.0 + (result.acceptance_rate or 0.0) * k)


def point_from_result(
    result, k: int, modelled: dict[str, float], decode_rate: float = 1.0, prefill_rate: float = 1.0
) -> dict[str, Any]:
    """One request's measured pieces (seconds) from its `RequestResult`. `modelled`: the prefill step and
    KV handoff as wall seconds (`prefill_s`, `kv_handoff_s`), the decode step at full speed (`decode_s`);
    a measured step of wall `t` leaves `t x rate - modelled full-speed seconds` (`planner.core_sharing`)."""
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
    prefill_end = modelled["prefill_s"]
    if ph.get("prefill_s") is not None:
        prefill_end = ph["prefill_s"]
        point["prefill_extra_s"] = (prefill_end - modelled["prefill_s"]) * prefill_rate
    point["first_token_extra_s"] = result.ttft_s - dispatch - modelled.get("sampled_s", modelled["prefill_s"])
    kv_transfer, admit = ph.get("kv_transfer_s"), ph.get("admit_s") or 0.0
    gap = 0.0
    if kv_transfer is not None:
        point["handoff_extra_s"] = kv_transfer + admit - prefill_end - modelled["kv_handoff_s"]
        gap = max(0.0, dispatch + kv_transfer + admit - result.ttft_s)
    first = ph.get("first_decode_step_s")
    if first is not None:
        point["first_decode_step_extra_s"] = first * decode_rate - modelled["decode_s"]
    num_steps = point["num_decode_steps"] = num_decode_steps(result, k)
    if first is not None and result.tpot_s is not None and num_steps > 1:
        # the steps after the first, at full speed, and their modelled seconds (`derive` pools them)
        rest_s = (result.tpot_s * (result.num_output_tokens - 1) - gap - first) * decode_rate
        point["later_steps"] = (num_steps - 1, rest_s, (num_steps - 1) * modelled["decode_s"])
        if num_steps >= MIN_DECODE_STEPS:
            point["decode_step_extra_s"] = (rest_s - point["later_steps"][2]) / (num_steps - 1)
    return point


def lone_rate(cores: float, driver_demand: float, background: float) -> float:
    """The speed `NodeCores` gives one busy engine beside the driver's and the background's demand."""
    return min(1.0, cores / (1.0 + driver_demand + background))


def _probe_point(result, prompt_len: int, m: dict[str, float], prefill: StepTimeModel, k: int,
                 rates: tuple[float, float]) -> dict[str, Any]:  # fmt: skip
    """`point_from_result` of one probe, its modelled prefill at the lone rate `rates[0]` (wall seconds)."""
    wall = {"prefill_s": m["prefill_s"] / rates[0], "sampled_s": m["sampled_s"] / rates[0],
            "decode_s": m["decode_s"]}  # fmt: skip
    call_s = result.phases.get("prefill_s") or wall["prefill_s"]
    wall["kv_handoff_s"] = prefill.kv_handoff_s(prompt_len, call_s)
    return point_from_result(result, k, wall, rates[1], rates[0])


def derive_from_probes(
    probes: list[dict[str, Any]],
    prefill: StepTimeModel,
    decode: StepTimeModel,
    k: int,
    cores: float,
    idle_cores: float | None = None,
) -> dict[str, Any]:
    """`{"values", "points"}` of `probes` (`probe_control_plane`'s: a `RequestResult` as a dict, the
    prompt length, the driver's CPU seconds), as the simulator on `cores` cores would replay them alone.
    The prefill rank's share = cores / (1 + driver + co-runners) gives the demand beside a lone prefill;
    of it, `idle_cores` (the node's busy cores while the cluster idled, `idle_busy_cores`) is the steady
    `background_cores` and the rest `prefill_corunner_cores` (present only while a prefill step runs);
    None: all of it steady. Probes with `after_pause_s` > 0 (sent after an idle pause) give only
    `idle_first_token_extra_s`. Raises ValueError when `probes` is empty."""
    from pdcluster.entrypoints.bench_client import RequestResult

    if not probes:
        raise ValueError("no measured request: cannot derive the control plane")
    paused = [p for p in probes if (p.get("after_pause_s") or 0) > 0]
    probes = [p for p in probes if p not in paused] or paused
    results = [RequestResult(**p["result"]) for p in probes]
    share = cpu_share(results)
    base = [_modelled(prefill, decode, p["prompt_len"], k) for p in probes]
    per_request, per_step = _line(
        [(num_decode_steps(r, k), p["host_cpu_s"]) for r, p in zip(results, probes, strict=True)]
    )
    decode_s, extra, cp = statistics.median(m["decode_s"] for m in base), 0.0, None
    prefill_extra = 0.0
    for _ in range(4):  # a step's driver demand depends on its extra, the extra on the step's rate
        # as `ClusterSimulator._start`: a prefill step's driver demand is its requests' CPU / its time
        prefill_driver = statistics.median(
            min(1.0, per_request / (m["prefill_s"] + prefill_extra)) for m in base
        )
        beside = max(0.0, cores / share - 1.0 - prefill_driver) if share < 1 else 0.0
        background = beside if idle_cores is None else min(beside, idle_cores)
        prefill_rate = lone_rate(cores, prefill_driver, beside)
        decode_rate = lone_rate(cores, min(1.0, per_step / (decode_s + extra)), background)
        points = []
        for r, p, m in zip(results, probes, base, strict=True):
            point = _probe_point(r, p["prompt_len"], m, prefill, k, (prefill_rate, decode_rate))
            points.append({**point, "host_cpu_s": p["host_cpu_s"], "cpu_share": share})
        cp = derive(points, background, (per_request, per_step), beside - background)
        extra, prefill_extra = cp.decode_step_extra_s, cp.prefill_extra_s
    rates = {"prefill": prefill_rate, "decode": decode_rate, "prefill_cpu_share": share}
    if paused and paused is not probes:  # their first-token excess over the in-turn probes'
        woken = [_probe_point(RequestResult(**p["result"]), p["prompt_len"],
                              _modelled(prefill, decode, p["prompt_len"], k), prefill, k,
                              (prefill_rate, decode_rate)) for p in paused]  # fmt: skip
        excess = statistics.median(w["first_token_extra_s"] for w in woken) - cp.first_token_extra_s
        cp = dataclasses.replace(cp, idle_first_token_extra_s=max(0.0, excess))
        points += [{**w, "after_pause_s": p["after_pause_s"]} for w, p in zip(woken, paused, strict=True)]
    return {"values": cp.to_dict(), "points": points, "lone_rates": rates}


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
    progress: Callable[[str], None] = lambda label: None, prompt_lens: Sequence[int] = PROMPT_LENS,
) -> dict[str, Any]:  # fmt: skip
    """Send `num_requests` requests one at a time to the server at `url` (serving `topology`, driven from
    this process), every other one with a quarter of `max_tokens`, then half as many short ones each after
    `IDLE_PAUSE_S` of idle, and derive the `ControlPlane`. Prompt lengths cycle through `prompt_lens` (an
    odd count gives each length both outputs). Returns `derive_from_probes`'s object with `probes` and
    `num_failed`. Raises ValueError: no request succeeded, or an empty or non-positive `prompt_lens`."""
    from pdcluster.entrypoints.bench_client import served_model
    from pdcluster.models.tokenizer import Tokenizer
    from pdcluster.planner.trace import TraceRequest, Workload, build_prompts

    if not prompt_lens or min(prompt_lens) < 1:
        raise ValueError(f"prompt_lens must be positive token counts, got {list(prompt_lens)!r}")
    k = topology.decode.num_speculative_tokens
    tokenizer = Tokenizer.from_dir(topology.engine_config("decode").model)
    num_sent = num_requests + 1 + max(1, num_requests // 2)
    lengths = [prompt_lens[i % len(prompt_lens)] for i in range(num_sent)]
    outputs = [
        max_tokens if i % 2 and i <= num_requests else max(2, max_tokens // 4) for i in range(num_sent)
    ]
    pauses = [IDLE_PAUSE_S if i > num_requests else 0.0 for i in range(num_sent)]
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
    sent = asyncio.run(_in_turn(url, every, prompts, model, progress, pauses))
    idle = idle_busy_cores()
    for (result, cpu_s), prompt_len, pause_s in list(zip(sent, lengths, pauses, strict=True))[1:]:
        if not result.ok or result.ttft_s is None:  # (the first warmed up)
            failed += 1
            continue
        measured.append((result, prompt_len, cpu_s, pause_s))
    if not measured:
        raise ValueError(f"none of {num_sent - 1} control-plane probes succeeded")
    probes = [
        {
            "result": dataclasses.asdict(result),
            "prompt_len": prompt_len,
            "host_cpu_s": cpu_s,
            "after_pause_s": pause_s,
        }
        for result, prompt_len, cpu_s, pause_s in measured
    ]
    derived = derive_from_probes(probes, prefill, decode, k, float(os.cpu_count() or 1), idle)
    return {**derived, "probes": probes, "num_failed": failed, "idle_cores": idle}


def busy_ticks(cpu_line: str) -> int:
    """Busy ticks of /proc/stat's `cpu` line (user nice system idle iowait irq softirq steal ...): all of
    the first eight but nice, idle and iowait. Raises ValueError for a line that is not one."""
    ticks = [int(v) for v in cpu_line.split()[1:9]]
    if len(ticks) < 8:
        raise ValueError(f"not a /proc/stat cpu line: {cpu_line!r}")
    return sum(ticks) - ticks[1] - ticks[3] - ticks[4]


def idle_busy_cores(window_s: float = IDLE_WINDOW_S) -> float | None:
    """Cores this machine keeps busy over `window_s` seconds (every process, from /proc/stat), measured
    while the cluster has no request: its steady background. Niced time is left out: under CFS a nice-19
    process weighs 15 against a nice-0 one's 1024, so it yields the cores to the cluster's processes.
    None where /proc/stat is unreadable."""

    def busy_s() -> float | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                return busy_ticks(f.readline()) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            return None

    start, start_s = busy_s(), time.perf_counter()
    time.sleep(window_s)
    end = busy_s()
    return None if start is None or end is None else max(0.0, (end - start) / (time.perf_counter() - start_s))


async def _in_turn(
    url: str, workload, prompts: list[list[int]], model: str, progress: Callable[[str], None],
    pauses: list[float],
) -> list[tuple[Any, float]]:  # fmt: skip
    """`send_in_turn`'s results, each with this process's CPU seconds while it ran (the driver's and the
    client's per-request work, as in a replay: one client for all, opened by the first); request i sent
    `pauses[i]` seconds after the previous one ended."""
    from pdcluster.entrypoints.bench_client import send_in_turn

    out, cpu_s = [], time.process_time()
    async for result in send_in_turn(url, workload, prompts, model):
        out.append((result, time.process_time() - cpu_s))
        if len(out) > 1:
            progress(f"control plane {len(out) - 1}/{len(prompts) - 1}")
        if len(out) < len(pauses) and pauses[len(out)] > 0:
            await asyncio.sleep(pauses[len(out)])  # the next request is sent when this loop resumes
        cpu_s = time.process_time()
    return out
