"""What the subcommands share: `CliError` (exit code 2), option types, the help formatter, model options."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdcluster.models import bundled_checkpoint_dir

PROG = "pdcluster"
EXIT_USAGE = 2


class CliError(Exception):
    """A problem the user can fix; `main` prints it as one line and exits with code 2."""


# Option types: argparse turns their ValueError into "argument --x: message".
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def tcp_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {text}")
    return value


tcp_port.__name__ = "port"
positive_int.__name__ = "positive integer"  # argparse names the type in "invalid <type> value" errors
non_negative_int.__name__ = "integer"
non_negative_float.__name__ = "number"
probability.__name__ = "number"


class HelpFormatter(argparse.RawDescriptionHelpFormatter): ...


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=bundled_checkpoint_dir(),
        metavar="DIR",
        help="checkpoint directory in Hugging Face layout: config.json (model_type deepseek_v3), "
        "model.safetensors (or an index + shards), tokenizer.json. "
        f"Default: the bundled tiny checkpoint, {bundled_checkpoint_dir()}",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu, cuda[:i] or npu[:i] (npu needs torch_npu). Default: cpu",
    )
