"""Live vs simulated, same YAML: `python -m bench.planner_fidelity [--json] [--calibrate] [--eager]`.

Per topology in `--clusters` and rate in `--rates`, the first `--num-requests` Azure conversation requests
are replayed live (deployed here, `pdcluster bench`'s client) and simulated (`planner.simulator` with the
calibration's step times, the live run's MTP acceptance, shared cores). The control plane is probed on
the same deployment just before the replay (`--probes` requests, `planner.control_plane`), so both see
the machine's load of that moment. Reports TTFT/TPOT p50/p90 of both and the simulated/live ratios;
`engine_only_over_live_*` leaves the control plane out; `sim_over_live_per_request` splits the per-request
ratios between requests that ran alone live and those that overlapped another (where contention acts).

`--calibrate` runs `pdcluster profile` (full grid, no control-plane probes) on each deployed file just
before its replays and simulates with it; `--eager` deploys, profiles and simulates copies of the files
with `compile: false` (else each file as written: compiled decode on `cpu` unless it says otherwise).
Every point keeps the raw probes and per-request live figures, and the output the calibrations it used,
so `--live-from RESULT.json` re-simulates a recorded run (the control plane derived again from its
probes) without deploying anything: for iterating on the planner against recorded live figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import Contention, add_json_option, emit, format_table, positive_int, ratio, source_revision

TRACE = "AzureLLMInferenceTrace_conv.csv"
QUANTILES = ("p50", "p90")
PROBE_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)  # of the replay's prompt lengths: five, so each gets both outputs


def live_point(
    cluster: str,
    rate_per_s: float,
    num_requests: int,
    max_tokens_cap: int,
    calibration: Path | None,
    show_progress: bool = False,
    trace: str = TRACE,
    num_probes: int = 12,
) -> dict[str, Any]:
    """Deploy `cluster`, probe its control plane and replay the trace at `rate_per_s`: a point's live half."""
    from pdcluster.config import load_topology
    from pdcluster.entrypoints.bench_client import run_bench, served_model
    from pdcluster.entrypoints.serve import serve
    from pdcluster.planner.control_plane import probe_control_plane
    from pdcluster.planner.plan import PlanOptions, step_models
    from pdcluster.planner.trace import arrival_rate_per_s, load_trace, scale_trace

    topology = load_topology(cluster)
    native_rate = arrival_rate_per_s(load_trace(trace, num_requests).requests)
    prefill_model, decode_model = step_models(topology, PlanOptions(trace=trace, calibration=calibration))
    with serve(topology, port=0, log=lambda message: None) as service:
        # the probes' prompts at quantiles of the replay's, their outputs at its cap: the steps it takes
        scaled = scale_trace(load_trace(trace, num_requests), served_model(service.url)[1], max_tokens_cap)
        lens = sorted(r.num_input_tokens for r in scaled.requests)
        quantiles = [lens[int(q * (len(lens) - 1))] for q in PROBE_QUANTILES]
        probed = probe_control_plane(service.url, topology, prefill_model, decode_model, num_probes,
                                     max_tokens_cap, prompt_lens=quantiles)  # fmt: skip
        live = run_bench(
            service.url,
            trace,
            tokenizer_dir=topology.engine_config("decode").model,
            num_requests=num_requests,
            time_scale=rate_per_s / native_rate,
            max_tokens_cap=max_tokens_cap,
            show_progress=show_progress,
        )
    point: dict[str, Any] = {
        "cluster": cluster,
        "rate_per_s": rate_per_s,
        "num_requests": num_requests,
        "workload": live.description,
        "live_num_failed": live.summary["num_failed"],
        "live_acceptance_rate": live.summary["mean_acceptance_rate"],
        "live_slo_ms": live.summary["slo"],
        "live_phases_p50_ms": _phases_p50_ms(live.results),
        # [input tokens, output tokens, TTFT s, TPOT s] per request in trace order (None: failed)
        "live_requests": [
            [r.num_input_tokens, r.num_output_tokens, r.ttft_s, r.tpot_s] if r.ok else None
            for r in live.results
        ],
        "control_plane_probes": probed["probes"],
        "control_plane_idle_cores": probed.get("idle_cores"),
    }
    for metric in ("ttft_ms", "tpot_ms"):
        for q in QUANTILES:
            point[f"live_{metric}_{q}"] = live.summary[metric][q]
    return point


def simulated_point(
    live: dict[str, Any], calibration: Path | None, trace: str, max_tokens_cap: int
) -> dict[str, Any]:
    """The simulation of `live`'s workload on its cluster: the control plane derived from its probes (or,
    for a record without them, its recorded values), and the simulated/live ratios."""
    import os

    from pdcluster.config import load_topology
    from pdcluster.planner.control_plane import ControlPlane, derive_from_probes
    from pdcluster.planner.plan import PlanOptions, cores_per_node, step_models
    from pdcluster.planner.simulator import SimOptions, pool_sizing, simulate
    from pdcluster.planner.trace import arrival_rate_per_s, load_trace, scale_trace

    topology = load_topology(live["cluster"])
    options = PlanOptions(trace=trace, calibration=calibration)
    prefill_model, decode_model = step_models(topology, options)
    k = topology.decode.num_speculative_tokens
    cores = cores_per_node(topology, options)
    point: dict[str, Any] = {}
    if live.get("control_plane_probes"):
        derived = derive_from_probes(
            live["control_plane_probes"],
            prefill_model,
            decode_model,
            k,
            cores or float(os.cpu_count() or 1),
            live.get("control_plane_idle_cores"),
        )
        values = derived["values"]
        point["lone_rates"] = {key: round(v, 4) for key, v in derived["lone_rates"].items()}
    else:  # recorded before the probes were kept: as measured then (ms, and cores)
        values = {key: v / 1e3 for key, v in live["control_plane_ms"].items()}
        values["background_cores"] = live["background_cores"]
    control_plane = ControlPlane(**values)
    acceptance = live["live_acceptance_rate"]
    n = live["num_requests"]
    sizing = {role: pool_sizing(topology, role) for role in ("prefill", "decode")}
    workload = scale_trace(
        load_trace(trace, n),
        sizing["decode"].scheduler.max_model_len,
        max_tokens_cap=max_tokens_cap,
        time_scale=live["rate_per_s"] / arrival_rate_per_s(load_trace(trace, n).requests),
    )
    slo = live.get("live_slo_ms") or {}
    draws = (acceptance if acceptance is not None else 0.0,) * k

    def simulated(cp: ControlPlane | None):
        return simulate(
            topology,
            workload.requests,
            SimOptions(prefill_model, decode_model, draws, control_plane=cp, cores_per_node=cores),
            prefill_sizing=sizing["prefill"],
            decode_sizing=sizing["decode"],
            ttft_slo_ms=slo.get("ttft_ms"),
            tpot_slo_ms=slo.get("tpot_ms"),
        )

    sim, engine_only = simulated(control_plane), simulated(None)  # engine_only: the A/B without the path
    point["sim_phases_p50_ms"] = _phases_p50_ms(sim.results)
    if live.get("live_requests") is not None:  # (recorded before per-request figures were kept: none)
        split = overlap_split(workload.requests, live["live_requests"], sim.results)
        point["sim_over_live_per_request"] = split
    point["sim_busy_fraction"] = sim.busy_fraction
    values = control_plane.to_dict()
    point["background_cores"] = round(values.pop("background_cores"), 3)
    point["prefill_corunner_cores"] = round(values.pop("prefill_corunner_cores"), 3)
    point["control_plane_ms"] = {key: round(v * 1e3, 3) for key, v in values.items()}
    for metric in ("ttft_ms", "tpot_ms"):
        value, live_value = engine_only.summary[metric]["p50"], live[f"live_{metric}_p50"]
        point[f"engine_only_over_live_{metric}_p50"] = (
            ratio(value, live_value) if None not in (value, live_value) else None
        )
    for metric in ("ttft_ms", "tpot_ms"):
        for q in QUANTILES:
            live_value, sim_value = live[f"live_{metric}_{q}"], sim.summary[metric][q]
            point[f"sim_{metric}_{q}"] = sim_value
            point[f"sim_over_live_{metric}_{q}"] = (
                ratio(sim_value, live_value) if None not in (sim_value, live_value) else None
            )
    return point


def live_and_simulated(
    cluster: str,
    rate_per_s: float,
    num_requests: int,
    max_tokens_cap: int,
    calibration: Path | None,
    **kw: Any,
) -> dict[str, Any]:
    """One point: `live_point` (same arguments) and the simulation of the same workload (module docstring)."""
    live = live_point(cluster, rate_per_s, num_requests, max_tokens_cap, calibration, **kw)
    return {**live, **simulated_point(live, calibration, kw.get("trace", TRACE), max_tokens_cap)}


def overlap_split(requests: list, live: list, sim: list) -> dict[str, dict[str, Any]]:
    """Median per-request simulated/live TTFT and TPOT, apart for the requests that ran alone live and those
    that overlapped another (live spans: arrival to arrival + TTFT + TPOT x (output tokens - 1))."""
    spans = [None if x is None else (r.arrival_s, r.arrival_s + x[2] + (x[3] or 0.0) * (x[1] - 1))
             for r, x in zip(requests, live, strict=True)]  # fmt: skip
    groups: dict[str, list[tuple[float, float | None]]] = {"alone": [], "overlapped": []}
    for i, (span, x, s) in enumerate(zip(spans, live, sim, strict=True)):
        if span is None or not s.ok:
            continue
        overlapped = any(o is not None and j != i and o[0] < span[1] and o[1] > span[0]
                         for j, o in enumerate(spans))  # fmt: skip
        tpot = s.tpot_s / x[3] if s.tpot_s is not None and x[3] else None
        groups["overlapped" if overlapped else "alone"].append((s.ttft_s / x[2], tpot))

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    return {
        name: {"num_requests": len(g), "ttft": med([t for t, _ in g]), "tpot": med([t for _, t in g if t])}
        for name, g in groups.items()
    }


def _phases_p50_ms(results: list) -> dict[str, float]:
    """The median of each phase the results carry (the server's `pdcluster.phases` live; the simulator's
    queue / prefill / kv_transfer / decode), in milliseconds."""
    names = sorted({name for r in results if r.ok for name in r.phases if name.endswith("_s")})
    return {
        name: round(statistics.median(r.phases[name] for r in results if r.ok and name in r.phases) * 1e3, 3)
        for name in names
    }


def eager_copy(cluster: str, directory: Path) -> str:
    """A copy of topology `cluster` in `directory` whose decode pool has `compile: false`."""
    import yaml

    doc = yaml.safe_load(Path(cluster).read_text(encoding="utf-8"))
    doc.setdefault("decode", {})["compile"] = False
    path = directory / Path(cluster).name
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return str(path)


def calibrate(cluster: str, directory: Path) -> Path:
    """`pdcluster profile` of `cluster` (full grid; the bench probes the control plane itself) into
    `directory`. Raises RuntimeError with its output when it fails."""
    output = directory / f"{Path(cluster).stem}.calibration.json"
    argv = [sys.executable, "-m", "pdcluster.entrypoints.cli", "profile", cluster, "--output", str(output),
            "--no-progress", "--control-plane-requests", "0"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pdcluster profile {cluster} failed:\n{done.stdout}\n{done.stderr}")
    return output


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="planner_fidelity_") as tmp:
        return resimulate(args, Path(tmp)) if args.live_from is not None else replay_all(args, Path(tmp))


def replay_all(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Every point live then simulated; eager copies and calibrations in `workdir` (kept in the output)."""
    points, calibrations = [], {}
    for cluster in args.clusters:
        deployed = eager_copy(cluster, workdir) if args.eager else cluster
        calibration = calibrate(deployed, workdir) if args.calibrate else args.calibration
        if calibration is not None:
            calibrations[cluster] = json.loads(Path(calibration).read_text(encoding="utf-8"))
        for rate in args.rates:
            live = live_point(deployed, rate, args.num_requests, args.max_tokens_cap, calibration,
                              not args.json, args.trace, args.probes)  # fmt: skip
            live["cluster"] = cluster
            live["deployed"] = deployed
            points.append({**live, **simulated_point(live | {"cluster": deployed}, calibration, args.trace,
                                                     args.max_tokens_cap)})  # fmt: skip
    return {
        "benchmark": "planner_fidelity",
        "config": {
            "trace": args.trace,
            "num_requests": args.num_requests,
            "max_tokens_cap": args.max_tokens_cap,
            "calibration": "--calibrate" if args.calibrate else args.calibration and str(args.calibration),
            "eager": args.eager,
            "control_plane_probes": args.probes,
            **source_revision(),
        },
        "calibrations": calibrations,
        "points": points,
    }


def resimulate(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """`--live-from`: the recorded live halves (a `bench.record` file or this bench's JSON) simulated again
    with today's planner; `--calibration` replaces the recorded calibrations."""
    recorded = json.loads(Path(args.live_from).read_text(encoding="utf-8"))
    recorded = recorded.get("output", recorded)
    config = recorded["config"]
    points = []
    for live in recorded["points"]:
        cluster, deployed = live["cluster"], live.get("deployed", live["cluster"])
        if config.get("eager") and not Path(deployed).exists():  # its temporary copy: made again
            deployed = eager_copy(cluster, workdir)
        calibration = args.calibration
        if calibration is None and cluster in recorded.get("calibrations", {}):
            calibration = workdir / f"{Path(cluster).stem}.calibration.json"
            calibration.write_text(json.dumps(recorded["calibrations"][cluster]), encoding="utf-8")
        elif calibration is None and config.get("calibration") not in (None, "--calibrate"):
            calibration = Path(config["calibration"])
        live_only = {key: v for key, v in live.items() if not key.startswith(("sim_", "engine_only_"))}
        simulated = simulated_point(live_only | {"cluster": deployed}, calibration, config["trace"],
                                    config["max_tokens_cap"])  # fmt: skip
        points.append({**live_only, **simulated})
    config = {**config, "live_from": str(args.live_from), "resimulated_at": source_revision()}
    if args.calibration is not None:
        config["calibration"] = str(args.calibration)
    calibrations = recorded.get("calibrations", {})
    return {"benchmark": "planner_fidelity", "config": config, "calibrations": calibrations, "points": points}


def table(result: dict[str, Any]) -> str:
    def f(value: float | None) -> str | None:
        return None if value is None else f"{value:.1f}"

    rows = []
    for p in result["points"]:
        rows.append(
            [
                Path(p["cluster"]).name,
                p["rate_per_s"],
                f(p["live_ttft_ms_p50"]),
                f(p["sim_ttft_ms_p50"]),
                p["sim_over_live_ttft_ms_p50"],
                f(p["live_tpot_ms_p50"]),
                f(p["sim_tpot_ms_p50"]),
                p["sim_over_live_tpot_ms_p50"],
                f"{f(p['live_ttft_ms_p90'])}/{f(p['sim_ttft_ms_p90'])}",
                p["sim_over_live_ttft_ms_p90"],
                f"{f(p['live_tpot_ms_p90'])}/{f(p['sim_tpot_ms_p90'])}",
                p["sim_over_live_tpot_ms_p90"],
            ]
        )
    header = ["cluster", "req/s", "TTFT p50 live", "sim", "sim/live", "TPOT p50 live", "sim", "sim/live",
              "TTFT p90 live/sim", "sim/live", "TPOT p90 live/sim", "sim/live"]  # fmt: skip
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.planner_fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--clusters", nargs="+", default=["clusters/local.yaml", "clusters/local-1p2d.yaml"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.5, 2.0], help="requests per second")
    parser.add_argument("--num-requests", type=positive_int, default=40)
    parser.add_argument("--max-tokens-cap", type=positive_int, default=64)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--calibration", type=Path, default=None, help="`pdcluster profile` JSON")
    source.add_argument("--calibrate", action="store_true", help="profile each file just before its replays")
    parser.add_argument("--eager", action="store_true", help="deploy copies of the files with compile: false")
    parser.add_argument(
        "--probes",
        type=positive_int,
        default=36,
        help="control-plane probes before each live replay (and half as many after an idle pause each), "
        "their prompts at quantiles of the replay's, their outputs at --max-tokens-cap",
    )
    parser.add_argument("--trace", default=TRACE, help="trace file (a bare name: ../shared/traces)")
    parser.add_argument(
        "--live-from", type=Path, default=None, help="re-simulate this recorded result; deploys nothing"
    )
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.live_from is not None and (args.calibrate or args.eager):
        parser.error("--live-from re-simulates a recorded run: --calibrate and --eager apply to live runs")
    contention = Contention()
    result = run(args)
    if args.live_from is None:
        result["config"].update(contention.stop())
    emit(result, args.json, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
