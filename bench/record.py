"""Run one benchmark and keep its latest result for ``bench/RESULTS.md``.

``python -m bench.record NAME -- python -m bench.X --json ...`` runs the command, takes the JSON object
it prints last on stdout, and writes ``bench/results/NAME.json`` with the command, the commit of the code
measured (``-dirty`` when the tree had changes), the machine and the date. ``python -m bench.results``
then regenerates ``bench/RESULTS.md`` from every file there. Only the latest run is kept: history is git's.

Raises ``SystemExit`` with the command's exit status when it fails or prints no JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_description() -> str:
    """One line naming the machine: cores, memory, accelerator (none here), CPU model."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem_gib:.0f} GiB, no accelerator ({cpu})"


def current_commit(repo: Path) -> str:
    """Short hash of HEAD, with ``-dirty`` when tracked files differ from it."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=repo).returncode != 0
    return sha.stdout.strip() + ("-dirty" if dirty else "")


def last_json_object(stdout: str) -> dict:
    """The last top-level JSON object in ``stdout`` (benchmarks may print progress lines before it)."""
    decoder = json.JSONDecoder()
    found = None
    index = 0
    while (start := stdout.find("{", index)) != -1:
        try:
            found, end = decoder.raw_decode(stdout, start)
            index = end
        except json.JSONDecodeError:
            index = start + 1
    if not isinstance(found, dict):
        raise ValueError("the command printed no JSON object on stdout (did you pass --json?)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="python -m bench.record NAME [--note TEXT] -- COMMAND ..."
    )
    parser.add_argument("name", help="result name: bench/results/NAME.json")
    parser.add_argument("--note", default="", help="what a reader should know (e.g. 'machine busy')")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("give the benchmark's command after --")
    repo = Path(__file__).resolve().parents[1]
    started = datetime.datetime.now(datetime.UTC)
    proc = subprocess.run(command, cwd=repo, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)
    try:
        output = last_json_object(proc.stdout)
    except ValueError as exc:
        raise SystemExit(f"bench.record: {exc}") from None
    display = [("python" if Path(part).name.startswith("python") else part) for part in command]
    record = {
        "name": args.name,
        "command": shlex.join(display),
        "commit": current_commit(repo),
        "machine": machine_description(),
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "note": args.note,
        "output": output,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"bench.record: wrote bench/results/{args.name}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
