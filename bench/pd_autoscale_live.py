"""Dynamic P:D live: `python -m bench.pd_autoscale --live --eager [--phase-s 15] [--calibration F] [--json]`.

This machine is profiled first (`pdcluster profile` of clusters/local.yaml: step times and the live
control plane; `--calibration` skips it), and the `local4` traces of `bench.pd_autoscale` are built and
simulated with that calibration and this machine's cores (`prepared`), so the live and simulated runs
share one model. The traces are replayed against real deployments: `pdcluster deploy` (a child process,
`bench.server_procs`) of clusters/local.yaml on 4 single-device instances, once per static split (1P3D,
2P2D, 3P1D, autoscale off) serving both traces, and with `autoscale: {enabled: true, calibration: ...}`
from 2P2D (the simulated start) deployed afresh for each trace. One client (`entrypoints.bench_client.
replay`: streamed `/v1/completions` of held-out token-id prompts at their arrival times, ignore_eos,
greedy), a few untimed warm-up requests per deploy. Goodput: requests meeting the YAML's TTFT and TPOT SLO
per second of the trace's arrival span; `lost_requests`: requests that failed or ended short. Each row
carries the simulated figures of the same trace, `sim_over_live` (simulated / live goodput) for the
controller and the best static split, the machine's load average and the run's `wall_s`; the output's
`config.calibration_json` is the calibration (`--calibration RESULT.json` simulates with it again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ratio
from bench.pd_autoscale import BENCH_AUTOSCALE, compare, prepared
from bench.server_procs import (
    ServerProcess,
    interrupt_on_sigterm,
    python_module_server,
    wait_all_ready,
)

NUM_DEVICES = 4
AUTOSCALE_START_PREFILL = 2  # the simulated start: clusters/local.yaml doubled (cluster_topology("local4"))
NUM_WARMUP_REQUESTS = 4


def topology_file(
    directory: Path,
    num_prefill: int,
    autoscale: bool,
    eager: bool = False,
    calibration: Path | None = None,
    num_devices: int = NUM_DEVICES,
    prefill_budget: int | None = None,
) -> Path:
    """clusters/local.yaml on `num_devices` single-device instances, `num_prefill` of them prefill, with
    the bench's `autoscale:` section when `autoscale` (its capacity priced with `calibration`), decode
    `compile: false` when `eager`, prefill's `max_num_batched_tokens` `prefill_budget` if given; written
    into `directory`."""
    import yaml

    from pdcluster.config.schema import DEFAULT_TOPOLOGY_PATH

    doc = yaml.safe_load(DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8"))
    doc["hardware"]["devices_per_node"] = num_devices
    doc["prefill"]["num_instances"] = num_prefill
    doc["decode"]["num_instances"] = num_devices - num_prefill
    if prefill_budget is not None:
        doc["prefill"]["max_num_batched_tokens"] = prefill_budget
    if eager:
        doc["decode"]["compile"] = False
    name = f"{num_prefill}P{num_devices - num_prefill}D" + ("_autoscale" if autoscale else "")
    if autoscale:
        doc["autoscale"] = {"enabled": True, **BENCH_AUTOSCALE}
        if calibration is not None:
            doc["autoscale"]["calibration"] = str(calibration)
    doc["name"] = f"pd-autoscale-{name}".replace("_", "-").lower()
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def measure_calibration(directory: Path, eager: bool, timeout_s: float) -> Path:
    """`pdcluster profile` (step grid and control-plane probes) of clusters/local.yaml, eager decode when
    `eager`, in a child process; the calibration JSON's path. Raises SystemExit when it fails."""
    path = topology_file(directory, 1, False, eager, num_devices=2)
    output = directory / "local4.calibration.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [
        sys.executable,
        "-m",
        "pdcluster.entrypoints.cli",
        "profile",
        str(path),
        "--output",
        str(output),
    ]
    done = subprocess.run(
        [*command, "--no-progress"], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"pdcluster profile failed ({done.returncode}): {done.stderr[-2000:]}")
    return output


def role_moves(url: str) -> dict[str, float]:
    """`pdcluster_role_moves` and `..._failed` from `/metrics`, summed over labels (0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"pdcluster_role_moves": 0.0, "pdcluster_role_moves_failed": 0.0}
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name in counts:
            counts[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return counts


def replay_trace(server: ServerProcess, requests: list, prompts: list, slo: tuple) -> dict[str, Any]:
    """Replay `requests` (arrival_s from 0) with `prompts`; goodput and losses under `slo` (ms)."""
    from pdcluster.config.slo import meets_slo
    from pdcluster.entrypoints.bench_client import replay, served_model
    from pdcluster.planner.trace import Workload

    start = min(r.arrival_s for r in requests)
    shifted = [dataclasses.replace(r, arrival_s=r.arrival_s - start) for r in requests]
    workload = Workload(shifted, "pd_autoscale trace", "conversation", 1.0)
    model, _ = served_model(server.url)
    results, duration_s = asyncio.run(replay(server.url, workload, prompts, model=model, show_progress=False))
    complete = [r for r in results if r.ok and r.num_output_tokens == r.num_output_tokens_requested]
    met = sum(meets_slo(r.ttft_s, r.tpot_s, slo[0], slo[1]) for r in complete)
    span_s = max(r.arrival_s for r in shifted)
    return {
        "num_requests": len(results),
        "met_slo": met,
        "goodput_requests_per_s": met / span_s if span_s > 0 else 0.0,
        "goodput_fraction": met / len(results),
        "lost_requests": len(results) - len(complete),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": round(duration_s, 2),
    }


def serve_and_replay(
    log_dir: Path, path: Path, traces: dict[str, list], prompts: dict, slo: tuple, timeout_s: float
) -> dict[str, dict[str, Any]]:
    """Deploy `path`, warm it up, replay each trace in turn; per trace the figures (and the moves)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    server = python_module_server(path.stem, "pdcluster.entrypoints.cli", ["deploy", str(path)], log_dir, env)
    out: dict[str, dict[str, Any]] = {}
    try:
        started = time.monotonic()
        wait_all_ready([server.start()], timeout_s)
        ready_s = round(time.monotonic() - started, 1)
        replay_trace(server, prompts["warmup"][0], prompts["warmup"][1], slo)
        for name, requests in traces.items():
            before = role_moves(server.url)
            out[name] = replay_trace(server, requests, prompts[name], slo)
            after = role_moves(server.url)
            out[name]["ready_s"] = ready_s
            out[name].update({k.removeprefix("pdcluster_role_"): after[k] - before[k] for k in after})
    finally:
        stopped = server.stop()
    for figures in out.values():
        figures["stopped_cleanly"] = not stopped["leaked_pids"] and not stopped["port_in_use"]
    return out


def live_row(
    trace: str, sim: dict[str, Any], auto: dict[str, Any], static: dict[str, dict]
) -> dict[str, Any]:
    """One `results` row: live controller vs live best static split, and the simulated figures."""
    best = max(static, key=lambda s: static[s]["met_slo"])
    sim_best = sim["best_static_split"]
    sim_static_goodput = sim["static_goodput_requests_per_s"][sim_best]
    return {
        "trace": trace,
        "cluster": "local4",
        "live": True,
        "num_requests": auto["num_requests"],
        "goodput_over_best_static": ratio(auto["met_slo"], static[best]["met_slo"]),
        "lost_requests": auto["lost_requests"],
        "static_lost_requests": {s: v["lost_requests"] for s, v in static.items()},
        "best_static_split": best,
        "goodput_requests_per_s": round(auto["goodput_requests_per_s"], 4),
        "goodput_fraction": round(auto["goodput_fraction"], 4),
        "static_goodput_requests_per_s": {
            s: round(v["goodput_requests_per_s"], 4) for s, v in static.items()
        },
        "static_goodput_fraction": {s: round(v["goodput_fraction"], 4) for s, v in static.items()},
        "num_moves": int(auto["moves"]),
        "num_failed_moves": int(auto["moves_failed"]),
        "errors": sorted({e for v in (auto, *static.values()) for e in v["errors"]})[:5],
        "sim_goodput_over_best_static": sim["goodput_over_best_static"],
        "sim_best_static_split": sim_best,
        "sim_goodput_requests_per_s": round(sim["goodput_requests_per_s"], 4),
        "sim_static_goodput_requests_per_s": round(sim_static_goodput, 4),
        "sim_over_live": ratio(sim["goodput_requests_per_s"], auto["goodput_requests_per_s"]),
        "sim_over_live_best_static": ratio(sim_static_goodput, static[best]["goodput_requests_per_s"]),
        "sim_over_live_goodput_over_best_static": ratio(
            sim["goodput_over_best_static"] or 0.0, ratio(auto["met_slo"], static[best]["met_slo"]) or 0.0
        ),
        "sim_lost_requests": sim["lost_requests"],
        "sim_num_moves": sim["num_moves"],
        "deploys": {"autoscale": auto, **static},
    }


def run_live(args: Any) -> list[dict[str, Any]]:
    """The `results` rows of `--live` (see the module docstring)."""
    from pdcluster.config.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
    from pdcluster.models.prompts import heldout_token_prompts
    from pdcluster.models.tokenizer import Tokenizer

    started = time.monotonic()
    tmp = tempfile.TemporaryDirectory(prefix="pd_autoscale_live_")
    directory = Path(tmp.name)
    calibration = Path(args.calibration or measure_calibration(directory, args.eager, args.ready_timeout_s))
    calibration = calibration.resolve()
    args.calibration_json = json.loads(calibration.read_text(encoding="utf-8"))
    topology, options, traces = prepared(
        "local4",
        args.phase_s,
        args.seed,
        args.max_requests,
        str(calibration),
        args.cores,
        args.load,
        args.max_output,
    )
    sim_rows = {r["trace"]: r for r in compare("local4", topology, options, traces, args.splits)}
    slo = (topology.slo.ttft_ms or DEFAULT_TTFT_SLO_MS, topology.slo.tpot_ms or DEFAULT_TPOT_SLO_MS)
    budget = topology.prefill.max_num_batched_tokens
    warmup = traces["steady"][:NUM_WARMUP_REQUESTS]
    sizes = [r.num_input_tokens for r in [*warmup, *traces["phase_shift"], *traces["steady"]]]
    ids = heldout_token_prompts(Tokenizer.from_dir(topology.engine_config("decode").model), sizes)
    num_shift = len(traces["phase_shift"])
    prompts = {
        "warmup": (warmup, ids[:NUM_WARMUP_REQUESTS]),
        "phase_shift": ids[NUM_WARMUP_REQUESTS : NUM_WARMUP_REQUESTS + num_shift],
        "steady": ids[NUM_WARMUP_REQUESTS + num_shift :],
    }
    load_before = os.getloadavg()[1]
    previous = interrupt_on_sigterm()
    static: dict[str, dict[str, dict]] = {name: {} for name in traces}
    auto: dict[str, dict] = {}
    try:
        for name, requests in traces.items():
            path = topology_file(
                directory, AUTOSCALE_START_PREFILL, True, args.eager, calibration, NUM_DEVICES, budget
            )
            got = serve_and_replay(directory, path, {name: requests}, prompts, slo, args.ready_timeout_s)
            auto[name] = got[name]
        for num_prefill in range(1, NUM_DEVICES):
            path = topology_file(directory, num_prefill, False, args.eager, None, NUM_DEVICES, budget)
            got = serve_and_replay(directory, path, traces, prompts, slo, args.ready_timeout_s)
            for name in traces:
                static[name][path.stem] = got[name]
    finally:
        import signal

        signal.signal(signal.SIGTERM, previous)
        tmp.cleanup()
    load = {
        "loadavg_5min_before": round(load_before, 2),
        "loadavg_5min_after": round(os.getloadavg()[1], 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    return [live_row(n, sim_rows[n], auto[n], static[n]) | load for n in traces]
