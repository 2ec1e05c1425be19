"""Simulator speed: simulated requests per wall second on a topology. `python -m bench.planner_speed`.

The Azure conversation trace repeated to `--num-requests` at `--rate` on clusters/cm384.yaml by default;
reports wall and CPU seconds of the simulation alone, events, steps and the simulated summary.

    python -m bench.planner_speed --json
    python -m bench.planner_speed --num-requests 20000 --profile   # cProfile top 20
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import format_table, main_measured, positive_int, source_revision


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdcluster.config import load_topology
    from pdcluster.planner.plan import PlanOptions, acceptance_for, step_models
    from pdcluster.planner.simulator import SimOptions, pool_sizing, simulate
    from pdcluster.planner.workload import plan_workload

    setup_start_s = time.perf_counter()
    topology = load_topology(args.topology)
    options = PlanOptions(
        trace=args.trace, weight_dtype=args.weight_dtype, acceptance_per_position=(args.acceptance,)
    )
    sizing = {role: pool_sizing(topology, role) for role in ("prefill", "decode")}
    workload = plan_workload(
        args.trace,
        sizing["decode"].scheduler.max_model_len,
        args.num_requests,
        args.rate,
        scale_to_context=args.scale_to_context,
    )
    prefill_model, decode_model = step_models(topology, options)
    setup_s = time.perf_counter() - setup_start_s
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start_s, start_cpu_s = time.perf_counter(), time.process_time()
    result = simulate(
        topology,
        workload.requests,
        SimOptions(prefill_model, decode_model, acceptance_for(topology, options)),
        prefill_sizing=sizing["prefill"],
        decode_sizing=sizing["decode"],
    )
    wall_s, cpu_s = time.perf_counter() - start_s, time.process_time() - start_cpu_s
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    summary = result.summary
    return {
        "benchmark": "planner_speed",
        "config": {
            "topology": args.topology,
            "workload": workload.description,
            "num_requests": len(workload.requests),
            "rate_per_s": args.rate,
            "weight_dtype": args.weight_dtype,
            "acceptance": args.acceptance,
            "profiled": bool(args.profile),
            **source_revision(),
        },
        "setup_s": round(setup_s, 3),
        "wall_s": round(wall_s, 3),
        # CPU seconds of this (single-threaded) process: what the wall time would be without other load
        "cpu_s": round(cpu_s, 3),
        "simulated_requests_per_wall_s": round(len(workload.requests) / wall_s, 1),
        "target_met_wall": len(workload.requests) >= 100_000 and wall_s <= 60.0,
        "target_met_cpu": len(workload.requests) >= 100_000 and cpu_s <= 60.0,
        "num_events": result.num_events,
        "num_steps": result.num_steps,
        "busy_fraction": {k: round(v, 3) for k, v in result.busy_fraction.items()},
        "simulated": {
            "duration_s": round(result.duration_s, 3),
            "num_ok": summary["num_ok"],
            "ttft_ms": summary["ttft_ms"],
            "tpot_ms": summary["tpot_ms"],
            "goodput_fraction": summary["goodput_fraction"],
            "goodput_requests_per_s": summary["goodput_requests_per_s"],
        },
    }


def table(result: dict[str, Any]) -> str:
    sim = result["simulated"]
    rows = [
        [
            result["config"]["num_requests"],
            result["wall_s"],
            result["cpu_s"],
            result["simulated_requests_per_wall_s"],
            result["num_events"],
            f"{result['num_steps']['prefill']}/{result['num_steps']['decode']}",
            f"{sim['ttft_ms']['p50']:.1f}" if sim["ttft_ms"]["p50"] is not None else None,
            f"{sim['tpot_ms']['p50']:.2f}" if sim["tpot_ms"]["p50"] is not None else None,
            f"{sim['goodput_fraction']:.3f}",
        ]
    ]
    header = [
        "requests",
        "wall s",
        "cpu s",
        "req/wall s",
        "events",
        "steps P/D",
        "p50 TTFT ms",
        "p50 TPOT ms",
        "goodput",
    ]
    return f"{result['config']['workload']}\n" + format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.planner_speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--topology", default="clusters/cm384.yaml")
    parser.add_argument("--trace", default="AzureLLMInferenceTrace_conv.csv")
    parser.add_argument("--num-requests", type=positive_int, default=100_000)
    parser.add_argument("--rate", type=float, default=800.0, help="requests per second (default 800)")
    parser.add_argument("--scale-to-context", type=positive_int, default=None)
    parser.add_argument("--weight-dtype", default="int8")
    parser.add_argument("--acceptance", type=float, default=0.7, help="MTP acceptance of the one draft")
    parser.add_argument("--profile", action="store_true", help="print the cProfile top 20 (slower run)")
    return main_measured(parser, argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
