"""The `pdcluster` command line: a thin shell over library functions, one module per subcommand.

Each subcommand module (`generate`, `demo`, `deploy`, `validate`, `accuracy`, `bench`, `profile`, `plan`)
declares `NAME`, `HELP`, `DESCRIPTION` (and optionally `EPILOG`, printed with their line breaks),
`add_arguments(parser)` and `run(args) -> exit code`; `common` holds the option types and `CliError`.

Every error the user can cause (bad options, topology, checkpoint, a port in use, a host not this machine's)
is one line on stderr per problem and exit code 2, never a traceback; `deploy` checks all it can before Ray
starts (`config.preflight`) and exits 0 on Ctrl-C and SIGTERM. Torch is imported only by the subcommands
that need it, so `--help` and option errors answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pdcluster.entrypoints.cli import accuracy, bench, demo, deploy, generate, plan, profile, validate
from pdcluster.entrypoints.cli.common import EXIT_USAGE, PROG, CliError, HelpFormatter

# in `pdcluster --help` order
SUBCOMMANDS = (generate, demo, deploy, validate, accuracy, bench, profile, plan)


def build_parser() -> argparse.ArgumentParser:
    """The `pdcluster` parser: one subparser per module of `SUBCOMMANDS` (`args.func` is its `run`)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Disaggregated prefill/decode serving for DeepSeek-V3-architecture models.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        subparser = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.DESCRIPTION,
            epilog=getattr(module, "EPILOG", None),
            formatter_class=HelpFormatter,
        )
        module.add_arguments(subparser)
        subparser.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `pdcluster` command; returns the exit code (0 ok, 2 usage or input error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or an option error (2, message already on stderr)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as exc:  # one line per problem (a topology file's issues: one FILE:LINE: reason each)
        for line in str(exc).splitlines() or [""]:
            print(f"{PROG} {args.command}: error: {line}", file=sys.stderr)
        return EXIT_USAGE
