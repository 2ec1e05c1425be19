"""Regenerate ``bench/RESULTS.md`` from the latest result of each benchmark in ``bench/results/``.

Each ``bench/results/NAME.json`` is written by ``python -m bench.record NAME -- COMMAND`` and holds the
command, the commit measured, the machine, the date and the benchmark's own JSON output. This renders
each as a section: how to rerun it, where it ran, and its output as tables (lists of flat objects) and
``key: value`` lines (scalars), nested objects under dotted keys. ``--check`` exits 1 when RESULTS.md is
not what the files give (a test runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
MAX_TABLE_ROWS = 40

HEADER = """# Benchmark results

The latest figure of each benchmark, one section per `bench/results/NAME.json`; history is in git.
Regenerate with `python -m bench.results` after `python -m bench.record NAME -- COMMAND`.
Figures are what one run saw on the machine named, not guarantees; compare only figures taken side by side
in one run. This file is generated: edit the JSON's source (rerun the benchmark), not this file.
"""


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (dict, list)) for v in value):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def _is_scalar(value: object) -> bool:
    return not isinstance(value, (dict, list)) or (
        isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value) and len(value) <= 8
    )


def _table(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k, v in row.items() if k not in columns and _is_scalar(v)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[:MAX_TABLE_ROWS]:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    if len(rows) > MAX_TABLE_ROWS:
        lines.append(f"\n({len(rows) - MAX_TABLE_ROWS} more rows in the JSON)")
    return lines


def render_output(output: object, prefix: str = "") -> list[str]:
    """Markdown lines for one benchmark's JSON: scalars as ``key: value``, lists of objects as tables."""
    lines: list[str] = []
    if isinstance(output, dict):
        scalars = [(k, v) for k, v in output.items() if _is_scalar(v)]
        for key, value in scalars:
            lines.append(f"- `{prefix}{key}`: {_fmt(value)}")
        for key, value in output.items():
            if not _is_scalar(value):
                lines += render_output(value, f"{prefix}{key}.")
    elif isinstance(output, list) and output and all(isinstance(r, dict) for r in output):
        lines += ["", f"`{prefix.rstrip('.')}`:", "", *_table(output), ""]
    elif isinstance(output, list):
        for index, item in enumerate(output):
            lines += render_output(item, f"{prefix}{index}.")
    return lines


def render(results_dir: Path = RESULTS_DIR) -> str:
    """The whole RESULTS.md text for the records in ``results_dir`` (sorted by name)."""
    parts = [HEADER]
    for path in sorted(results_dir.glob("*.json")):
        record = json.loads(path.read_text())
        parts.append(f"## {record['name']}\n")
        parts.append(f"`{record['command']}`\n")
        where = f"commit {record['commit']}, {record['date']}, {record['machine']}"
        parts.append(where + (f". {record['note']}" if record.get("note") else "") + "\n")
        parts.append("\n".join(render_output(record["output"])).strip() + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
        if current != text:
            print("bench/RESULTS.md is out of date: run python -m bench.results", file=sys.stderr)
            return 1
        return 0
    RESULTS_MD.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
