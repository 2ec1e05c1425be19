"""`pdcluster validate FILE...`: check topology files as plans, or with --for-deploy as deploy would."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdcluster.entrypoints.cli.deploy import deploy_preflight


def run(args: argparse.Namespace) -> int:
    from pdcluster.config import TopologyError, read_topology
    from pdcluster.config.preflight import actor_layer_issues, autoscale_live_issues, weight_dtype_issues

    exit_code = 0
    for path in args.files:
        try:
            if args.for_deploy:
                topology = deploy_preflight(path, None)
                notes = []
            else:
                loaded = read_topology(path)
                topology = loaded.topology
                notes = (
                    actor_layer_issues(topology)
                    + weight_dtype_issues(topology)
                    + autoscale_live_issues(topology)
                )
                notes = loaded.locate(notes)
        except TopologyError as exc:
            print(exc, file=sys.stderr)
            exit_code = 1
            continue
        print(f"{path}: ok — {topology.summary()}" + (" (deployable here)" if args.for_deploy else ""))
        for note in notes:
            where = f"{note.file}:{note.line}" if note.line else note.file
            print(f"{where}: note: {note.reason} (valid as a plan; --for-deploy refuses it)", file=sys.stderr)
    return exit_code


NAME = "validate"
HELP = "check topology YAML files (clusters/*.yaml) without starting anything"
DESCRIPTION = """\
Read each topology file and check it: keys and types, choices, parallelism against the
model's config.json, each pool's weights (in model.weight_dtype) + KV cache against one
device's memory, device counts and placement (clusters/README.md lists the rules).
Prints one summary line per valid file on stdout and one FILE:LINE: reason line per
problem on stderr. Exit code: 0 all files valid, 1 some file invalid, 2 usage error.

A file is checked as a plan: it may describe a cluster this machine is not part of. What
`pdcluster deploy` cannot run (tensor-parallel attention, experts split over part of an
instance, a model.weight_dtype other than model.dtype) is valid as a plan and printed as a
"note" line on stderr.

--for-deploy checks what `pdcluster deploy FILE` checks before it starts Ray, here and now:
also the actor layer's and the weight dtype's limits (errors, no longer notes), the
checkpoint as this machine sees it (config.json, safetensors headers not truncated, every
tensor present with its shape, tokenizer.json; no weights are read) and that api.host:api.port
can be bound. A file it calls ok is one deploy will not refuse before starting Ray."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="topology YAML files")
    parser.add_argument(
        "--for-deploy",
        action="store_true",
        help="also check what `pdcluster deploy` needs on this machine (see above)",
    )
