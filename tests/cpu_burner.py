"""Run a command while bounded CPU burners keep every core busy: `make test-under-load` uses it.

    python -m tests.cpu_burner [--num-burners N] [--max-seconds S] -- COMMAND [ARGS...]

Starts N processes (default: one per core) that spin in a tight loop at normal priority, runs COMMAND,
then stops the burners and exits with COMMAND's exit status. Each burner also stops by itself after
`--max-seconds` (default 3600) and when its parent dies, so nothing keeps spinning after a crash.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time


def _burn(deadline_s: float, parent_pid: int) -> None:
    """Spin until `deadline_s` (time.monotonic) or until the parent process is gone."""
    checks = 0
    while time.monotonic() < deadline_s:
        for _ in range(200_000):  # ~10 ms of pure-Python work between checks
            checks += 1
        if os.getppid() != parent_pid:
            return


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(
            "usage: python -m tests.cpu_burner [--num-burners N] [--max-seconds S] -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m tests.cpu_burner", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--num-burners", type=int, default=os.cpu_count() or 1, help="busy processes (default: cores)"
    )
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="each burner stops after this long")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command or args.num_burners < 0 or args.max_seconds <= 0:
        parser.error("a COMMAND after --, --num-burners >= 0 and --max-seconds > 0 are required")

    deadline_s = time.monotonic() + args.max_seconds
    ctx = mp.get_context("spawn")
    burners = [
        ctx.Process(target=_burn, args=(deadline_s, os.getpid()), daemon=True)
        for _ in range(args.num_burners)
    ]
    for burner in burners:
        burner.start()
    print(
        f"cpu_burner: {len(burners)} burners busy (at most {args.max_seconds:.0f} s);"
        f" running {' '.join(command)}",
        flush=True,
    )
    started_s = time.monotonic()
    try:
        returncode = subprocess.call(command)
    finally:
        for burner in burners:
            burner.terminate()
        for burner in burners:
            burner.join(timeout=5)
    print(
        f"cpu_burner: command exited {returncode} after {time.monotonic() - started_s:.0f} s under load",
        flush=True,
    )
    return returncode


if __name__ == "__main__":
    sys.exit(main())
