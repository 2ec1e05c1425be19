"""Dynamic P:D against the best static split: `python -m bench.pd_autoscale [--clusters local4,cm384]
[--calibration FILE] [--live [--eager]] [--phase-s 60] [--json]`; simulated unless `--live`
(`bench.pd_autoscale_live`: the local4 traces replayed against real deploys, with these figures beside).

Per cluster (`--clusters`: `local4` = clusters/local.yaml on 4 single-device instances, `cm384` =
clusters/cm384.yaml with both pools at its prefill shape, 32 dies), two traces built from the Azure
conversation trace: `phase_shift` (prompt-heavy rows, then output-heavy rows, then prompt-heavy again,
`--phase-s` each) and `steady` (all rows mixed; `bench.pd_autoscale_traces`). Arrival gaps are Azure's,
rescaled to a rate the perf model prices: a phase's hot pool needs `HOT_INSTANCES_FRACTION` of the
instances, the steady trace `STEADY_LOAD` of all (local4 on a machine, `--calibration`/`--live`: of
min(instances, `--cores`), its instances sharing the cores as processes do: `planner.core_sharing`). Each
trace runs on every static split (`planner.simulator`) and with the controller (`planner.autoscale_sim`,
starting from the file's split; a quarter of the instances may move at once; prefill's step budget at most
half the TTFT SLO: `prefill_budget_within_slo`). Goodput: requests within the SLO per second of the
trace's arrival span, the same for every run of one trace, so `goodput_over_best_static` is the ratio of
requests within the SLO; `*_per_s_of_duration` divides by each run's own first-arrival to last-answer time
instead. `lost_requests`: requests that did not complete.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from bench.common import add_json_option, emit, format_table, ratio, source_revision
from bench.pd_autoscale_traces import MAX_OUTPUT_TOKENS, Pricing, build_traces, thinned

MACHINE_MAX_OUTPUT_TOKENS = 64  # local4 priced on this machine (--calibration, --live)
BENCH_AUTOSCALE = {"interval_s": 0.5, "window_s": 3.0, "dwell_s": 5.0, "drain_timeout_s": 30.0}


def cluster_topology(name: str, calibration: str | None = None):  # noqa: ANN201
    """The topology of `--clusters` NAME (see the module docstring), autoscale enabled (pricing capacity
    with `calibration`)."""
    from pdcluster.config import load_topology
    from pdcluster.config.autoscale import AutoscaleConfig
    from pdcluster.config.schema import DEFAULT_TOPOLOGY_PATH

    if name == "local4":
        t = load_topology(DEFAULT_TOPOLOGY_PATH)
        t = dataclasses.replace(
            t,
            hardware=dataclasses.replace(t.hardware, devices_per_node=4),
            prefill=dataclasses.replace(t.prefill, num_instances=2),
            decode=dataclasses.replace(t.decode, num_instances=2),
        )
    elif name == "cm384":
        t = load_topology(DEFAULT_TOPOLOGY_PATH.parent / "cm384.yaml")
        per_die_seqs = t.decode.max_num_seqs // t.decode.devices_per_instance
        shape = t.prefill.devices_per_instance
        decode = dataclasses.replace(
            t.decode,
            num_instances=t.decode.num_devices // shape,
            devices_per_instance=shape,
            expert_parallel_size=shape,
            max_num_seqs=per_die_seqs * shape,
            max_num_batched_tokens=per_die_seqs * shape * (1 + t.decode.num_speculative_tokens),
        )
        t = dataclasses.replace(t, decode=decode)
    else:
        raise SystemExit(f"unknown cluster {name!r} (local4, cm384)")
    total = t.prefill.num_instances + t.decode.num_instances
    config = AutoscaleConfig(
        enabled=True, max_moves_in_flight=max(1, total // 4), calibration=calibration, **BENCH_AUTOSCALE
    )
    return dataclasses.replace(t, autoscale=config)


def prefill_budget_within_slo(topology, prefill_model, prompt_len: int = 1024):  # noqa: ANN001, ANN201
    """`topology` with prefill's `max_num_batched_tokens` lowered (multiples of `prompt_len`) until a full
    step of `prompt_len`-token prompts takes at most half the TTFT SLO (a prompt waits for the step in
    progress, then its own); unchanged when it already does. Raises SystemExit when no step fits."""
    from pdcluster.config.slo import DEFAULT_TTFT_SLO_MS
    from pdcluster.planner.step_model import PrefillChunk, StepShape

    bound_s = (topology.slo.ttft_ms or DEFAULT_TTFT_SLO_MS) / 2000
    budget = topology.prefill.max_num_batched_tokens

    def step_s(num_tokens: int) -> float:
        chunk = min(prompt_len, num_tokens)
        return prefill_model.step_time_s(StepShape((PrefillChunk(chunk),) * (num_tokens // chunk)))

    if step_s(budget) <= bound_s:
        return topology
    fits = [n for n in range(prompt_len, budget, prompt_len) if step_s(n) <= bound_s]
    if not fits:
        raise SystemExit(f"no prefill step of {prompt_len} tokens fits half the TTFT SLO ({bound_s} s)")
    return dataclasses.replace(
        topology, prefill=dataclasses.replace(topology.prefill, max_num_batched_tokens=fits[-1])
    )


def with_split(topology, num_prefill: int):  # noqa: ANN001, ANN201
    total = topology.prefill.num_instances + topology.decode.num_instances
    return dataclasses.replace(
        topology,
        prefill=dataclasses.replace(topology.prefill, num_instances=num_prefill),
        decode=dataclasses.replace(topology.decode, num_instances=total - num_prefill),
    )


def prepared(
    name: str,
    phase_s: float,
    seed: int,
    max_requests: int | None = None,
    calibration: str | None = None,
    cores: float | None = None,
    load: float = 1.0,
    max_output: int = MAX_OUTPUT_TOKENS,
):  # noqa: ANN201
    """(topology, SimOptions, {trace name: requests}) of cluster `name`. `calibration`: a `pdcluster
    profile` JSON pricing the steps, the control plane (its `control_plane`) and the controller's
    capacity (`autoscale.calibration`); `cores`: the CPU node's cores the instances share (None: unshared)."""
    from pdcluster.planner.control_plane import control_plane_from_calibration
    from pdcluster.planner.plan import PlanOptions, acceptance_for, step_models
    from pdcluster.planner.sim_options import SimOptions

    topology = cluster_topology(name, calibration)
    options = PlanOptions(trace="AzureLLMInferenceTrace_conv.csv", seed=seed, calibration=calibration)
    prefill_model, decode_model = step_models(topology, options)
    topology = prefill_budget_within_slo(topology, prefill_model)
    acceptance = acceptance_for(topology, options)
    control_plane = control_plane_from_calibration(calibration)
    pricing = Pricing(topology, prefill_model, decode_model, acceptance, control_plane)
    traces = build_traces(topology, pricing, phase_s, seed, cores, load, max_output)
    traces = {k: thinned(v, max_requests) for k, v in traces.items()}
    sim = SimOptions(
        prefill_model,
        decode_model,
        acceptance,
        seed,
        control_plane,
        cores if cores is not None and not topology.hardware.spec.is_accelerator else None,
    )
    return topology, sim, traces


def run_cluster(name: str, args: Any) -> list[dict[str, Any]]:
    """One row per trace of `--traces` on cluster `name` (`args`: the parsed command line)."""
    local = name == "local4"
    calibration = str(args.calibration) if args.calibration and local else None
    topology, options, traces = prepared(
        name,
        args.phase_s,
        args.seed,
        args.max_requests,
        calibration,
        args.cores if local else None,
        args.load,
        args.max_output if local else MAX_OUTPUT_TOKENS,
    )
    if unknown := set(names := args.traces.split(",")) - set(traces):
        raise SystemExit(f"--traces: unknown {sorted(unknown)} (phase_shift, steady)")
    static = tuple(int(n) for n in args.static_splits.split(",") if n)
    traces = {k: v for k, v in traces.items() if k in names}
    return compare(name, topology, options, traces, args.splits, static)


def compare(
    name: str,
    topology: Any,
    options: Any,
    traces: dict[str, list],
    splits: int,
    static_splits: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """The simulated rows: each trace on every static split (prefill instances `static_splits`, else about
    `splits` of them evenly spaced, the start and the ends) and with the controller."""
    from pdcluster.planner.autoscale_sim import simulate_autoscale
    from pdcluster.planner.simulator import simulate

    total = topology.prefill.num_instances + topology.decode.num_instances
    step = max(1, (total - 1) // splits)
    candidates = sorted(static_splits) or sorted(
        {*range(1, total, step), topology.prefill.num_instances, total - 1}
    )
    if not all(0 < n < total for n in candidates):
        raise SystemExit(f"--static-splits: prefill instances must be in [1, {total - 1}], got {candidates}")
    rows = []
    for trace_name, requests in traces.items():
        static = {}
        for num_prefill in candidates:
            summary = simulate(with_split(topology, num_prefill), requests, options).summary
            static[f"{num_prefill}P{total - num_prefill}D"] = summary
        auto = simulate_autoscale(topology, requests, options)
        span_s = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
        met = {s: v["goodput_fraction"] * v["num_requests"] for s, v in static.items()}
        best_split = max(met, key=lambda s: met[s])
        summary = auto.result.summary
        auto_met = summary["goodput_fraction"] * summary["num_requests"]
        rows.append(
            {
                "trace": trace_name,
                "cluster": name,
                "num_requests": len(requests),
                "goodput_over_best_static": ratio(auto_met, met[best_split]),
                "goodput_over_best_static_per_s_of_duration": ratio(
                    summary["goodput_requests_per_s"],
                    max(v["goodput_requests_per_s"] for v in static.values()),
                ),
                "lost_requests": summary["num_failed"],
                "best_static_split": best_split,
                "goodput_requests_per_s": auto_met / span_s,
                "goodput_fraction": summary["goodput_fraction"],
                "static_goodput_requests_per_s": {s: m / span_s for s, m in met.items()},
                "static_goodput_fraction": {s: v["goodput_fraction"] for s, v in static.items()},
                "static_lost_requests": {s: v["num_failed"] for s, v in static.items()},
                "start_split": f"{topology.prefill.num_instances}P{topology.decode.num_instances}D",
                "num_moves": sum(m.outcome == "done" for m in auto.moves),
                "num_aborted_moves": sum(m.outcome == "aborted" for m in auto.moves),
                "moves": [
                    {
                        "decided_s": round(m.decided_s, 2),
                        "instance": m.instance_id,
                        "move": f"{m.source}->{m.target}",
                    }
                    for m in auto.moves
                ],
            }
        )
    return rows


def calibration_file(path: Path) -> Path:
    """`path` if it is a calibration JSON, else the calibration a recorded `--live` result carries
    (`output.config.calibration_json`) written to a temporary file. Raises SystemExit for neither."""
    import json
    import tempfile

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--calibration {path}: not a readable JSON file ({exc})") from None
    if "format" in raw:
        return path
    carried = raw.get("output", raw).get("config", {}).get("calibration_json")
    if not isinstance(carried, dict):
        raise SystemExit(f"--calibration {path}: neither a calibration nor a --live result carrying one")
    with tempfile.NamedTemporaryFile("w", suffix=".calibration.json", delete=False) as out:
        json.dump(carried, out)
    return Path(out.name)


def table(result: dict[str, Any]) -> str:
    header = ["cluster", "trace", "auto/best static", "lost", "best static", "auto goodput", "moves"]
    rows = [
        [
            r["cluster"],
            r["trace"],
            f"{r['goodput_over_best_static']:.3f}",
            r["lost_requests"],
            r["best_static_split"],
            f"{r['goodput_requests_per_s']:.2f}",
            r["num_moves"],
        ]
        for r in result["results"]
    ]
    return format_table(header, rows)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m bench.pd_autoscale",
        description="Dynamic P:D against the best static split (simulated; --live: also live).",
        epilog="--live (bench.pd_autoscale_live): `pdcluster profile` of this machine, then 5 deploys of "
        "clusters/local.yaml on 4 devices (about 1 min each with --eager, several with the decode compile) "
        "and 8 replays of 3 x --phase-s each: about 15 min at --eager --phase-s 15 on a quiet machine. "
        "--load 1.5 there: the calibrated model has the SLO binding in every phase and the static splits "
        "apart.",
    )
    add_json_option(parser)
    parser.add_argument(
        "--clusters",
        default="local4",
        help="comma-separated: local4, cm384 (simulated; each trace's rate is sized to the cluster's "
        "instances). Default: local4",
    )
    parser.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase. Default: 60")
    parser.add_argument(
        "--splits", type=int, default=6, help="static splits tried at most (about). Default: 6"
    )
    parser.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="at most this many requests per trace, evenly thinned (a lower load). Default: all",
    )
    parser.add_argument(
        "--static-splits",
        default="",
        help="comma-separated prefill instance counts of the static splits to try (instead of --splits' "
        "grid; the best static is the best of these). Default: the grid",
    )
    parser.add_argument("--traces", default="phase_shift,steady", help="comma-separated. Default: both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="local4: a `pdcluster profile` JSON of this machine (--live writes one) pricing steps, control "
        "plane and the controller's capacity; its instances then share --cores. Default: the catalog",
    )
    parser.add_argument(
        "--cores",
        type=float,
        default=None,
        help="local4: the cores its 4 instances share (rates sized to min(4, cores) instances). Default: "
        "this machine's with --calibration or --live, else unshared",
    )
    parser.add_argument(
        "--load", type=float, default=1.0, help="every trace's arrival rate times this. Default: 1"
    )
    parser.add_argument(
        "--max-output",
        type=int,
        default=None,
        help=f"output tokens cap. Default: {MACHINE_MAX_OUTPUT_TOKENS} with --calibration or --live (short "
        f"requests: a phase of seconds reaches its steady load), else {MAX_OUTPUT_TOKENS}",
    )
    parser.add_argument(
        "--live",
        action="store_true",
        help="also deploy local4 live (autoscale on from 2P2D, and each static split) and replay the "
        "same traces: bench.pd_autoscale_live",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="--live: decode `compile: false` (deploys start in about a minute instead of several)",
    )
    parser.add_argument("--ready-timeout-s", type=float, default=900.0, help="per deploy (--live)")
    args = parser.parse_args()
    machine = args.calibration is not None or args.live
    if args.cores is None and machine:
        args.cores = float(os.cpu_count() or 1)
    if args.max_output is None:
        args.max_output = MACHINE_MAX_OUTPUT_TOKENS if machine else MAX_OUTPUT_TOKENS
    if args.max_output < 1:
        parser.error(f"--max-output must be >= 1, got {args.max_output}")
    if args.calibration is not None:
        args.calibration = calibration_file(args.calibration)
    if not args.load > 0 or (args.cores is not None and not args.cores > 0):
        parser.error(f"--load and --cores must be > 0, got {args.load}, {args.cores}")
    if args.max_requests is not None and args.max_requests < 1:
        parser.error(f"--max-requests must be >= 1, got {args.max_requests}")
    if args.live:
        from bench.pd_autoscale_live import run_live

        results = run_live(args)
    else:
        results = [row for name in args.clusters.split(",") for row in run_cluster(name, args)]
    result = {
        "results": results,
        "simulated": not args.live,
        "config": {
            "autoscale": BENCH_AUTOSCALE,
            "phase_s": args.phase_s,
            "seed": args.seed,
            "static_splits": args.static_splits or f"grid of --splits {args.splits}",
            "max_requests": args.max_requests,
            "calibration": str(args.calibration) if args.calibration else None,
            "cores": args.cores,
            "load": args.load,
            "max_output": args.max_output,
            "calibration_json": getattr(args, "calibration_json", None),
            "live": args.live,
            "eager": args.eager,
        },
        **source_revision(),
    }
    emit(result, args.json, table)


if __name__ == "__main__":
    main()
