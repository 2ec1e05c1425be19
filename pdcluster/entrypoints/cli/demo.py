"""`pdcluster demo` (`make demo`): deploy the default topology, complete a few prompts, replay a trace."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdcluster.config import DEFAULT_TOPOLOGY_PATH, TopologyError
from pdcluster.entrypoints.cli.common import CliError, positive_int
from pdcluster.planner.trace import default_trace_dir


def run(args: argparse.Namespace) -> int:
    from pdcluster.driver.cluster import DeployError
    from pdcluster.entrypoints.demo import run_demo

    if not args.trace.exists():
        raise CliError(f"--trace {args.trace}: no such file (the public traces live in ../shared/traces)")
    try:
        return run_demo(args.cluster, args.trace, args.num_requests, args.max_tokens_cap, sys.stdout)
    except (TopologyError, DeployError) as exc:
        raise CliError(str(exc)) from exc


NAME = "demo"
HELP = "the main job: deploy clusters/local.yaml, replay 50 Azure trace requests, print a summary"
DESCRIPTION = f"""\
What `make demo` runs. Starts a local Ray cluster from the embedded default topology
({DEFAULT_TOPOLOGY_PATH}: one prefill and one decode actor serving the bundled tiny
model, KV streamed layer by layer through shared memory, MTP speculative decoding on decode, the
decode forward compiled at load: tens of seconds, which a --cluster file with
`decode: compile: false` skips), puts the OpenAI-compatible API in front of it on a free
port, completes three held-out prompts, replays the first --num-requests requests of the
Azure conversation trace at their arrival times (lengths scaled to the model's context; the
scaling is printed), prints TTFT/TPOT percentiles, throughput, goodput under the SLO, MTP
acceptance and KV transfer time, then shuts everything down."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster",
        type=Path,
        default=DEFAULT_TOPOLOGY_PATH,
        metavar="FILE",
        help="topology YAML to deploy. Default: clusters/local.yaml (1 prefill + 1 decode, bundled model)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=default_trace_dir() / "AzureLLMInferenceTrace_conv.csv",
        metavar="FILE",
        help="trace to replay (Azure .csv or Mooncake .jsonl). Default: the Azure conversation trace",
    )
    parser.add_argument("--num-requests", type=positive_int, default=50, metavar="N", help="Default: 50")
    parser.add_argument(
        "--max-tokens-cap",
        type=positive_int,
        default=64,
        metavar="N",
        help="cap on each request's output tokens (the trace's output lengths are clamped). Default: 64",
    )
