"""`pdcluster plan FILE --trace T`: simulate a topology on a trace (`planner.simulator`) with the performance
model (`planner.perf_model`), print the `pdcluster bench` summary and write a report with plots; with
`--search`, rank splits of the file's hardware and write the best one as a topology file."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pdcluster.entrypoints.cli.common import CliError, non_negative_int, positive_int
from pdcluster.planner import DEFAULT_ACCEPTANCE


def _acceptance(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(","))
    if not values or not all(0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be probabilities in [0, 1], comma-separated, got {text}")
    return values


_acceptance.__name__ = "acceptance list"


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


_positive_float.__name__ = "number"


def _rank_loss(text: str):
    from pdcluster.planner.rank_loss import parse_rank_loss

    try:
        return parse_rank_loss(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_rank_loss.__name__ = "rank loss"


def validate(args: argparse.Namespace) -> int:
    """`--validate`: the published deployments predicted (`planner.published`), per row and a summary."""
    from pdcluster.planner.published import table_text
    from pdcluster.planner.published import validate as evaluate_published

    result = evaluate_published()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table_text(result))
    return 0


def run(args: argparse.Namespace) -> int:
    from pdcluster.config import TopologyError, read_topology
    from pdcluster.planner.plan import PlanOptions, run_plan

    if args.validate:
        return validate(args)
    if args.file is None or args.trace is None:
        raise CliError("FILE and --trace are required (except with --validate)")
    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"--out must be a directory: {args.out} exists and is not one")
    try:
        topology = read_topology(args.file).topology
    except TopologyError as exc:
        raise CliError(str(exc)) from exc
    options = PlanOptions(
        trace=str(args.trace),
        num_requests=args.num_requests,
        rate_per_s=args.rate,
        max_tokens_cap=args.max_tokens_cap,
        scale_to_context=args.scale_to_context,
        acceptance_per_position=args.acceptance,
        seed=args.seed,
        calibration=args.calibration,
        weight_dtype=args.weight_dtype,
        ep_imbalance=args.ep_imbalance,
        search=args.search,
        search_num_requests=args.search_num_requests,
        sweep=not args.no_sweep,
        rank_losses=tuple(args.fail_rank),
    )
    try:
        outcome = run_plan(args.file, topology, options, args.out, show_progress=not args.json)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    autoscale = None
    if args.autoscale:
        from pdcluster.planner.autoscale_sim import plan_autoscale

        autoscale = plan_autoscale(topology, options)
    if args.json:
        print(
            json.dumps(
                {**outcome.as_json(), **({"autoscale": autoscale.as_json()} if autoscale else {})}, indent=2
            )
        )
    else:
        print(outcome.as_text() + (f"\n{autoscale.as_text()}" if autoscale else ""))
    print(f"report: {outcome.report_path}", file=sys.stderr)
    return 0


NAME = "plan"
HELP = "simulate a topology on a trace (capacity planning): summary, report with plots, --search"
DESCRIPTION = """\
Simulate FILE's cluster on a request trace, without starting anything: a discrete-event
simulation that calls the live router, dispatch and scheduler policies, with step times
from the performance model (pdcluster/planner/perf_model.py: FLOPs and bytes per op priced
by published kernel measurements by shape where the catalog has them (DeepGEMM, FlashMLA,
FlashAttention-3, DeepEP, CloudMatrix-Infer), two micro-batches on a timeline, DP and EP
imbalance, KV transfer over the prefill->decode link). --validate shows the model's error
against published deployments. On cpu, instances sharing a node's cores slow each other.
The trace's recorded lengths are kept, inputs clamped only to what the model holds (the
summary says how many), outputs capped at --max-tokens-cap; --scale-to-context scales
them to another context instead.

Prints the same summary table as `pdcluster bench` (TTFT/TPOT/e2e percentiles,
throughput, goodput under the YAML's slo), and writes into --out a Markdown report with
PNG plots: TTFT/TPOT CDFs, goodput per device against the P:D ratio (a sweep over the
number of prefill instances), per-phase time breakdown.

--search enumerates splits of FILE's hardware (instances per pool, devices per
instance, EP degree, decode max_num_seqs, MTP k), simulates each on the first
--search-num-requests requests, ranks them by goodput per device under the SLO, adds
the frontier of goodput per device against TPOT to the report, and writes the best
split as OUT/plan.yaml, a topology file `pdcluster validate` accepts."""
EPILOG = """\
examples:
  pdcluster plan --validate          # the model against published deployments, with its error
  pdcluster plan clusters/cm384.yaml --trace AzureLLMInferenceTrace_conv.csv --rate 800 \\
      --num-requests 20000 --weight-dtype int8 --acceptance 0.7
  pdcluster plan clusters/local.yaml --trace AzureLLMInferenceTrace_conv.csv --rate 2 \\
      --num-requests 50 --calibration calibration.json --search"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `pdcluster plan`."""
    parser.add_argument(
        "file", type=Path, nargs="?", metavar="FILE", help="topology YAML file (clusters/*.yaml)"
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="predict the shipped table of published deployments (DeepSeek, RTP-LLM, CloudMatrix-Infer) and "
        "print predicted, published and error per row and a summary (with --json: one object whose "
        "summary holds checks, within_15pct, beyond_25pct, max_abs_error as a fraction); needs no FILE",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="T",
        help="trace file (.csv Azure, .jsonl Mooncake); a bare name is looked up in ../shared/traces",
    )
    parser.add_argument(
        "--num-requests",
        type=positive_int,
        default=None,
        metavar="N",
        help="simulate N requests (the trace repeated when shorter). Default: the whole trace",
    )
    parser.add_argument(
        "--rate",
        type=_positive_float,
        default=None,
        metavar="R",
        help="mean arrival rate in requests/s (the trace's arrival times scaled). Default: the trace's",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("plan-report"),
        metavar="DIR",
        help="where report.md, the PNG plots and (--search) plan.yaml go. Default: plan-report",
    )
    parser.add_argument("--search", action="store_true", help="search splits of the hardware (see above)")
    parser.add_argument(
        "--search-num-requests",
        type=positive_int,
        default=500,
        metavar="N",
        help="requests simulated per search candidate and per P:D sweep point (the first N of the "
        "workload: too few rank a start-up transient, not a steady state). Default: 500",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the P:D sweep (one simulation only)")
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help="also simulate the dynamic P:D controller (the file's autoscale section, enabled) from its "
        "split: its goodput and every move with its reason",
    )
    parser.add_argument(
        "--max-tokens-cap", type=positive_int, default=128, metavar="N", help="output cap. Default: 128"
    )
    parser.add_argument(
        "--scale-to-context",
        "--context-len",  # its former name
        dest="scale_to_context",
        type=positive_int,
        default=None,
        metavar="N",
        help="scale the trace's input lengths by N / the trace's reference context (Azure 8192, Mooncake "
        "131072), as `pdcluster bench` does. Default: keep the recorded lengths",
    )
    parser.add_argument(
        "--acceptance",
        type=_acceptance,
        default=None,
        metavar="A[,A2,...]",
        help="MTP acceptance per draft position (of draft i given drafts < i accepted). Default: "
        f"{DEFAULT_ACCEPTANCE} per position (DeepSeek-V3 report, section 5.4.3)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the acceptance draws")
    parser.add_argument(
        "--calibration",
        type=Path,
        default=None,
        metavar="JSON",
        help="efficiency factors measured by `pdcluster profile` (for the cpu entry)",
    )
    parser.add_argument(
        "--weight-dtype",
        default=None,
        metavar="DTYPE",
        help="weight dtype of the model (e.g. int8, fp8, bfloat16). Default: model.weight_dtype of FILE "
        "(auto: its model.dtype)",
    )
    parser.add_argument(
        "--ep-imbalance",
        type=_positive_float,
        default=None,
        metavar="X",
        help="slowest EP rank's routed load over the mean (>= 1). Default: the model's statistical estimate",
    )
    parser.add_argument(
        "--fail-rank",
        type=_rank_loss,
        action="append",
        default=[],
        metavar="ROLE I:RANK@T[+R]",
        help="lose rank RANK of instance I of pool ROLE (prefill or decode) T seconds after the first "
        "arrival, e.g. decode0:3@60: its instance serves nothing for R seconds (default: the pool's "
        "elastic_stall_s, the live wait before a silent rank is lost; re-forming not counted), its requests "
        "on that rank are prefilled again with the tokens streamed kept, then it "
        "serves on one rank less (KV blocks, experts re-placed by models.elastic_placement and the EP "
        "imbalance that leaves; refused, as live, when the survivors' device memory cannot hold every "
        "expert). Repeatable; the plan's own simulation only, not the sweep or search",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
