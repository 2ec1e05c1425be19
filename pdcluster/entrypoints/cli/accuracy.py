"""`pdcluster accuracy FILE`: the configuration a topology describes against the full-precision reference,
per length band, and the gate of its `accuracy` section (`entrypoints.accuracy_gate`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdcluster.entrypoints.cli.common import positive_int

EXIT_GATE_FAILED = 1


def run(args: argparse.Namespace) -> int:
    import torch

    from pdcluster.config import TopologyError, load_topology
    from pdcluster.entrypoints.accuracy_gate import evaluate_topology, format_report
    from pdcluster.entrypoints.cli.common import CliError

    torch.set_num_threads(args.threads)
    try:
        topology = load_topology(args.file)
    except TopologyError as exc:
        raise CliError(str(exc)) from None
    try:
        report = evaluate_topology(topology)
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(f"{args.file}: {exc}") from None
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_report(report))
    if not report.passed:
        print(f"pdcluster accuracy: {args.file}: gate failed: {'; '.join(report.failures)}", file=sys.stderr)
        return EXIT_GATE_FAILED
    return 0


# ---- parser ----------------------------------------------------------------------------------------
NAME = "accuracy"
HELP = "score a topology's configuration (KV dtypes, MTP, weight dtype) against full precision"
DESCRIPTION = """\
Run the configuration FILE describes (model and weight dtype, the KV dtype policy of
kv_precision or decode.kv_cache_dtype, MTP when decode.num_speculative_tokens > 0)
and the float32 reference on held-out text of the bundled corpus, per length band
(kv_precision's bands, else accuracy.band_lengths, else context/8, /2, all of it):

  top1       teacher-forced: fraction of positions whose argmax equals the reference's
  mean KL    teacher-forced: KL(reference || configuration), nats per position
  MTP acc    greedy acceptance of the first MTP draft (configuration and reference)
  repetition free-running greedy generations to the long band's length: fraction of
             tokens whose 4-gram already occurred (configuration and reference)

Expert parallelism is measured as one process (same per-expert arithmetic).
The gate checks accuracy.min_top1_agreement, max_mean_kl, max_mtp_acceptance_drop and
max_repetition_rate_increase. Exit code: 0 passed, 1 a threshold not met (each named
on stderr), 2 bad file or usage. `pdcluster deploy --require-accuracy` runs this first."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `pdcluster accuracy`."""
    parser.add_argument("file", type=Path, metavar="FILE", help="topology YAML file")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="torch intra-op threads (default 1: the measurement is many small ops, and on a busy machine "
        "idle-waiting threads spin for cores they do not get)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object: metrics per band, passed, failures"
    )
