"""`pdcluster profile FILE`: measure this engine over step shapes and KV transfers; fit the `cpu` entry."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdcluster.entrypoints.cli.common import CliError


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pdcluster.config import TopologyError, load_topology
    from pdcluster.planner import control_plane as cp
    from pdcluster.planner import profiling
    from pdcluster.planner.efficiency import get_efficiency
    from pdcluster.planner.topology_models import perf_model_for

    try:
        topology = load_topology(args.file)
    except TopologyError as exc:
        raise CliError(str(exc)) from exc
    if args.control_plane_requests is not None and args.control_plane_requests < 0:
        raise CliError(f"--control-plane-requests must be >= 0, got {args.control_plane_requests}")
    accelerator = topology.hardware.accelerator
    if accelerator != "cpu":
        raise CliError(
            f"{args.file}: hardware.accelerator is {accelerator!r}; profile measures the engine on this "
            "machine, so it takes a topology whose accelerator is 'cpu' (e.g. clusters/local.yaml)"
        )
    output = args.output or Path(f"{topology.name}.calibration.json")
    grid = profiling.Grid.default(quick=args.quick)
    models = {role: perf_model_for(topology, role) for role in ("prefill", "decode")}
    total = len(grid.prefill) + len(grid.decode) + 1
    with tqdm(total=total, desc="profile", unit="point", file=sys.stderr, disable=args.no_progress) as bar:

        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        try:
            samples = profiling.measure_steps(topology, grid, progress, seed=args.seed)
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot run the engine of {args.file}: {exc}") from exc
        bar.total = len(samples) + 1
        model = models["decode"]
        kv = profiling.measure_kv(
            model.config, model.dtypes.kv, grid.kv_tokens, grid.repeats, topology.kv_transport
        )
        progress("kv transfer")
    if not samples:
        raise CliError(f"{args.file}: no grid point fits the pools' token budgets and seats")
    eff, fit = profiling.fit_efficiency(models, samples, get_efficiency("cpu"))
    link = model.kv_link.bandwidth_bytes_per_s
    eff = eff.replace(kv_link=kv["bytes_per_s"] / link, handoff_overhead_s=kv["fixed_s"])
    fitted = [n for n in profiling.UNKNOWNS if n not in fit["not_identified"]] + [
        "kv_link",
        "handoff_overhead_s",
    ]
    rows = profiling.residuals(models, samples, eff)
    control_plane = None
    num_probes = args.control_plane_requests
    if num_probes is None:
        num_probes = cp.QUICK_REQUESTS if args.quick else cp.DEFAULT_REQUESTS
    if num_probes > 0:
        calibrated = {role: m.with_efficiency(eff) for role, m in models.items()}
        max_tokens = cp.QUICK_MAX_TOKENS if args.quick else cp.DEFAULT_MAX_TOKENS
        try:
            control_plane = cp.measure_control_plane(
                topology, calibrated["prefill"], calibrated["decode"], num_probes, max_tokens
            )
        except ValueError as exc:
            raise CliError(f"control-plane probes on the live cluster of {args.file} failed: {exc}") from exc
    report = {
        "topology": str(args.file),
        "grid": {
            "prefill": list(grid.prefill),
            "decode": list(grid.decode),
            "repeats": grid.repeats,
            "decode_steps": grid.decode_steps,
            "kv_tokens": list(grid.kv_tokens),
        },  # fmt: skip
        "fitted_factors": fitted,
        "fit": fit,
        "kv_transfer": kv,
        "residuals": rows,
    }
    if control_plane is not None:
        report["control_plane"] = control_plane
    profiling.write_calibration(output, accelerator, eff, report)
    table = profiling.summary_table(rows, kv)
    if control_plane is not None:
        values = ", ".join(
            f"{k} {v:.2f} cores" if k.endswith("_cores") else f"{k} {v * 1e3:.2f} ms"
            for k, v in control_plane["values"].items()
        )
        paused = sum(1 for p in control_plane["points"] if p.get("after_pause_s"))
        probes = f"{len(control_plane['points']) - paused} probes one at a time, {paused} after an idle pause"
        table += f"\ncontrol plane (live, {probes}): {values}"
    output.with_suffix(".txt").write_text(table + "\n", encoding="utf-8")
    print(table)
    print(f"calibration written to {output} (table: {output.with_suffix('.txt')}); "
          f"plan with it: pdcluster plan ... --calibration {output}")  # fmt: skip
    return 0


NAME = "profile"
HELP = "measure the engine here and fit the planner's cpu efficiency factors (a calibration JSON)"
DESCRIPTION = """\
Build one engine per pool of FILE (a topology whose hardware.accelerator is cpu), time
engine steps over a grid of prefill (batch x prompt length) and decode (batch x context
length) shapes and KV handoffs over FILE's KV transport (shm, or gRPC on 127.0.0.1), and
fit the planner's cpu factors (GEMM and attention efficiency, memory efficiency, per-op and
per-step host overhead, KV throughput) by non-negative least squares (pdcluster/planner/profiling.py
says how).

Step times are CPU seconds of the stepping thread with torch at one thread (as the rank
actors run), so other processes' load stays out of them; KV handoffs are wall clock.
Writes the fit, every sample and its residual as JSON to --output and a short table
beside it (.txt); the planner reads the JSON back (perf_model_for(..., calibration=PATH)).
Then FILE is deployed here and a few requests run one at a time to measure the live
control-plane path (route + reserve, handoff fixed costs, admission, first and later decode
steps' host work) against the calibrated model; the simulator adds these (control_plane)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", help="topology YAML (accelerator: cpu)")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="PATH",
        help="calibration JSON to write (default: ./<topology name>.calibration.json)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny grid and one repeat (tests, smoke runs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--control-plane-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests sent one at a time to FILE's live cluster to measure route/reserve, handoff, "
        "admission and per-decode-step costs (pdcluster/planner/control_plane.py), then half as many after "
        "an idle pause each (the first token of a request that finds the cluster idle); default 12 "
        "(--quick 4); 0 skips",
    )
