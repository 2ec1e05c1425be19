"""Live vs simulated, same YAML: `python -m bench.planner_fidelity [--json]`.

Per topology in `--clusters` and rate in `--rates`, the first `--num-requests` Azure conversation requests
are replayed live (deployed here, `pdcluster bench`'s client) and simulated (`planner.simulator` with
`--calibration`'s step times, the live run's MTP acceptance, shared cores). The control plane is probed on
the same deployment just before the replay (`--probes` requests, `planner.control_plane`), so both see
the machine's load of that moment. Reports TTFT/TPOT p50/p90 of both and the simulated/live ratios;
`engine_only_over_live_*` leaves the control plane out. The live side runs under other processes' CPU
load (`other_processes_cpu_fraction`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.common import format_table, main_measured, positive_int, ratio, source_revision

TRACE = "AzureLLMInferenceTrace_conv.csv"


def live_and_simulated(
    cluster: str,
    rate_per_s: float,
    num_requests: int,
    max_tokens_cap: int,
    calibration: Path | None,
    show_progress: bool = False,
    trace: str = TRACE,
    num_probes: int = 12,
) -> dict[str, Any]:
    """One point: the live replay and the simulation of the same workload (see the module docstring)."""
    from pdcluster.config import load_topology
    from pdcluster.entrypoints.bench_client import run_bench
    from pdcluster.entrypoints.serve import serve
    from pdcluster.planner.control_plane import DEFAULT_MAX_TOKENS, ControlPlane, probe_control_plane
    from pdcluster.planner.plan import PlanOptions, cores_per_node, step_models
    from pdcluster.planner.simulator import pool_sizing, simulate
    from pdcluster.planner.trace import arrival_rate_per_s, load_trace, scale_trace

    topology = load_topology(cluster)
    native_rate = arrival_rate_per_s(load_trace(trace, num_requests).requests)
    time_scale = rate_per_s / native_rate
    options = PlanOptions(trace=trace, calibration=calibration)
    prefill_model, decode_model = step_models(topology, options)
    with serve(topology, port=0, log=lambda message: None) as service:
        probed = probe_control_plane(
            service.url, topology, prefill_model, decode_model, num_probes, DEFAULT_MAX_TOKENS
        )
        live = run_bench(
            service.url,
            trace,
            tokenizer_dir=topology.engine_config("decode").model,
            num_requests=num_requests,
            time_scale=time_scale,
            max_tokens_cap=max_tokens_cap,
            show_progress=show_progress,
        )
    k = topology.decode.num_speculative_tokens
    acceptance = live.summary["mean_acceptance_rate"]
    acceptance_per_position = (acceptance if acceptance is not None else 0.0,) * k
    sizing = {role: pool_sizing(topology, role) for role in ("prefill", "decode")}
    workload = scale_trace(
        load_trace(trace, num_requests),
        sizing["decode"].scheduler.max_model_len,
        max_tokens_cap=max_tokens_cap,
        time_scale=time_scale,
    )

    def simulated(control_plane):
        return simulate(
            topology,
            workload.requests,
            prefill_model,
            decode_model,
            acceptance_per_position,
            prefill_sizing=sizing["prefill"],
            decode_sizing=sizing["decode"],
            ttft_slo_ms=live.summary["slo"]["ttft_ms"],
            tpot_slo_ms=live.summary["slo"]["tpot_ms"],
            control_plane=control_plane,
            cores_per_node=cores_per_node(topology, options),
        )

    control_plane = ControlPlane(**probed["values"])
    sim = simulated(control_plane)
    engine_only = simulated(None)  # the same simulation without the control-plane path, for the A/B
    point: dict[str, Any] = {
        "cluster": cluster,
        "rate_per_s": rate_per_s,
        "num_requests": num_requests,
        "workload": live.description,
        "live_num_failed": live.summary["num_failed"],
        "live_acceptance_rate": acceptance,
    }
    point["live_phases_p50_ms"] = _phases_p50_ms(live.results)
    point["sim_phases_p50_ms"] = _phases_p50_ms(sim.results)
    point["sim_busy_fraction"] = sim.busy_fraction
    values = control_plane.to_dict()
    point["background_cores"] = round(values.pop("background_cores"), 3)
    point["control_plane_ms"] = {k: round(v * 1e3, 3) for k, v in values.items()}
    point["control_plane_num_probes"] = len(probed["points"])
    for metric in ("ttft_ms", "tpot_ms"):
        value, live_value = engine_only.summary[metric]["p50"], live.summary[metric]["p50"]
        point[f"engine_only_over_live_{metric}_p50"] = (
            ratio(value, live_value) if None not in (value, live_value) else None
        )
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p90"):
            live_value, sim_value = live.summary[metric][q], sim.summary[metric][q]
            point[f"live_{metric}_{q}"] = live_value
            point[f"sim_{metric}_{q}"] = sim_value
            point[f"sim_over_live_{metric}_{q}"] = (
                ratio(sim_value, live_value) if None not in (sim_value, live_value) else None
            )
    return point


def _phases_p50_ms(results: list) -> dict[str, float]:
    """The median of each phase the results carry (the server's `pdcluster.phases` live; the simulator's
    queue / prefill / kv_transfer / decode), in milliseconds."""
    import statistics

    names = sorted({name for r in results if r.ok for name in r.phases if name.endswith("_s")})
    return {
        name: round(statistics.median(r.phases[name] for r in results if r.ok and name in r.phases) * 1e3, 3)
        for name in names
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    points = [
        live_and_simulated(
            cluster,
            rate,
            args.num_requests,
            args.max_tokens_cap,
            args.calibration,
            not args.json,
            args.trace,
            args.probes,
        )
        for cluster in args.clusters
        for rate in args.rates
    ]
    return {
        "benchmark": "planner_fidelity",
        "config": {
            "trace": args.trace,
            "num_requests": args.num_requests,
            "max_tokens_cap": args.max_tokens_cap,
            "calibration": str(args.calibration) if args.calibration else None,
            "control_plane_probes": args.probes,
            **source_revision(),
        },
        "points": points,
    }


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
                f"{f(p['live_tpot_ms_p90'])}/{f(p['sim_tpot_ms_p90'])}",
            ]
        )
    header = [
        "cluster",
        "req/s",
        "TTFT p50 live",
        "sim",
        "sim/live",
        "TPOT p50 live",
        "sim",
        "sim/live",
        "TTFT p90 live/sim",
        "TPOT p90 live/sim",
    ]
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
    parser.add_argument("--calibration", type=Path, default=None, help="`pdcluster profile` JSON")
    parser.add_argument(
        "--probes", type=positive_int, default=12, help="control-plane probes before each live replay"
    )
    parser.add_argument("--trace", default=TRACE, help="trace file (a bare name: ../shared/traces)")
    return main_measured(parser, argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
