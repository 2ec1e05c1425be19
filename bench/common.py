"""What every benchmark shares: the run's environment record, CLI options, statistics and output.

Each benchmark is `python -m bench.<name> [--json]`: one JSON object on stdout with `--json`, a short
table otherwise. Nothing here downloads anything; the checkpoint is a local directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pdcluster.models import bundled_checkpoint_dir

DEFAULT_VLLM_VENV = Path(
    os.environ.get("PDCLUSTER_VLLM_VENV", Path(__file__).resolve().parents[2] / "vllm-venv")
)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model` (checkpoint directory, default: the bundled one) and `--json`."""
    parser.add_argument(
        "--model",
        type=Path,
        default=bundled_checkpoint_dir(),
        help="checkpoint directory (config.json, model.safetensors, tokenizer.json); "
        "default: the bundled tiny checkpoint (%(default)s). Never downloaded.",
    )
    add_json_option(parser)
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch intra-op threads (torch.set_num_threads); default: torch's own choice "
        "(OMP_NUM_THREADS, else the core count). 1 is steadier on a shared machine.",
    )


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_vllm_venv_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        default=DEFAULT_VLLM_VENV,
        help="venv of vLLM's CPU build (../shared/PEERS.md); default: $PDCLUSTER_VLLM_VENV, else vllm-venv "
        "beside the repository (%(default)s)",
    )


def missing_vllm(venv: Path) -> str | None:
    return None if (venv / "bin" / "python").exists() else f"no vLLM venv at {venv} (see ../shared/PEERS.md)"


def new_parser(module: str, description: str) -> argparse.ArgumentParser:
    """A benchmark's parser (`prog`: `python -m <module>`) with `add_common_arguments`' options."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    add_common_arguments(parser)
    return parser


def main_with(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    problem: Callable[[argparse.Namespace], str | None] = lambda args: None,
) -> int:
    """A benchmark's `main`: parse `argv`, refuse a bad `--model` or what `problem(args)` names
    (`parser.error`: exit status 2), then `run_and_emit(run(args))`; returns 0."""
    args = parser.parse_args(argv)
    why = check_checkpoint(args.model) or problem(args)
    if why:
        parser.error(why)
    run_and_emit(lambda: run(args), args, table)
    return 0


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """argparse type: `"1,8,32"` -> `[1, 8, 32]`."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def check_checkpoint(path: Path) -> str | None:
    """None if `path` looks like a checkpoint directory, else why not (for a clean CLI error)."""
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (path / f).exists()]
    if missing:
        return f"{path}: not a checkpoint directory (missing {', '.join(missing)}); pass --model DIR"
    return None


def environment(checkpoint: Path) -> dict[str, Any]:
    """Where and with what the benchmark ran: threads, versions, machine, checkpoint."""
    info: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "checkpoint": str(checkpoint.resolve()),
        "checkpoint_bytes": (checkpoint / "model.safetensors").stat().st_size,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    info.update(source_revision())
    log = checkpoint / "train_log.json"
    if log.exists():  # written by models.train_tiny: tells a throwaway checkpoint from the trained one
        try:
            info["checkpoint_train_steps"] = json.loads(log.read_text())["args"]["steps"]
        except (ValueError, KeyError, TypeError):
            pass
    return info


def source_revision() -> dict[str, Any]:
    """The git commit of the source tree the benchmark imported, and which of its files were modified."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.rstrip("\n") if done.returncode == 0 else None

    modified = git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_modified_files": None if modified is None else [line[3:] for line in modified.splitlines()],
    }


def summarize_ms(values_s: Sequence[float]) -> dict[str, float]:
    """Seconds -> `{"mean", "p50", "p90", "min", "max"}` in milliseconds (p90: nearest-rank)."""
    ms = sorted(v * 1e3 for v in values_s)
    if not ms:
        return {}
    p90 = ms[min(len(ms) - 1, max(0, -(-9 * len(ms) // 10) - 1))]
    return {
        "mean": round(statistics.fmean(ms), 4),
        "p50": round(statistics.median(ms), 4),
        "p90": round(p90, 4),
        "min": round(ms[0], 4),
        "max": round(ms[-1], 4),
    }


def ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


class Contention:
    """CPU seconds that other processes used while a measurement ran (from /proc/stat minus this process).

    On a small shared machine, another process on one core can slow a multi-threaded torch run many times
    over; a measurement with a large `other_processes_cpu_fraction` should be rerun on an idle machine.
    Linux only; elsewhere the figures are None.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        busy_s = (sum(fields[:8]) - fields[3] - fields[4]) / ticks_per_s  # all but idle and iowait
        own = os.times()
        return busy_s, own.user + own.system, time.perf_counter()

    def stop(self) -> dict[str, float | None]:
        """`{"other_processes_cpu_s", "other_processes_cpu_fraction"}` since construction; the fraction is
        of all the machine's CPU time in that wall time."""
        end = self._sample()
        if self._start is None or end is None:
            return {"other_processes_cpu_s": None, "other_processes_cpu_fraction": None}
        other_s = max(0.0, (end[0] - self._start[0]) - (end[1] - self._start[1]))
        wall_s = end[2] - self._start[2]
        return {
            "other_processes_cpu_s": round(other_s, 2),
            "other_processes_cpu_fraction": round(other_s / (wall_s * (os.cpu_count() or 1)), 3),
        }


def run_and_emit(
    run: Callable[[], dict[str, Any]],
    args: argparse.Namespace,
    table: Callable[[dict[str, Any]], str],
) -> None:
    """Run a benchmark with `args.threads` torch threads and print its result (`measure_and_emit`)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    measure_and_emit(run, args.json, table)


def main_measured(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
) -> int:
    """A `main` for a benchmark without a model (no `add_common_arguments`): parse `argv` with `--json`
    added, then `measure_and_emit(run(args))`; returns 0."""
    add_json_option(parser)
    args = parser.parse_args(argv)
    measure_and_emit(lambda: run(args), args.json, table)
    return 0


def measure_and_emit(
    run: Callable[[], dict[str, Any]], as_json: bool, table: Callable[[dict[str, Any]], str]
) -> None:
    """Run a benchmark and print its result (`emit`), with the machine's 1-minute load average before the
    run and the CPU time other processes used during it (`Contention`) in its "config"."""
    load_before = os.getloadavg()[0]
    contention = Contention()
    result = run()
    result["config"]["load_avg_1min_before_run"] = round(load_before, 2)
    result["config"].update(contention.stop())
    emit(result, as_json, table)


def emit(result: dict[str, Any], as_json: bool, table: Callable[[dict[str, Any]], str]) -> None:
    """Print `result` as one JSON object (`as_json`) or as the benchmark's table."""
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(table(result) + "\n")


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width text table."""
    cells = [[str(h) for h in header]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
