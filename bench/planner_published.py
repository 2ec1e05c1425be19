"""The performance model against published DeepSeek-V3/R1 deployments: `python -m bench.planner_published`.

The same evaluation as `pdcluster plan --validate` (`pdcluster.planner.published`: the shipped table of
published deployments, each row with its source; the fitted factors and how they were fitted in
`pdcluster.planner.fit`). Prints predicted, published and error per row and the summary; `--json` one object
whose `summary` holds `checks`, `within_15pct`, `beyond_25pct` and `max_abs_error` (a fraction);
`--breakdown` each row's step by op; `--fit` refits the factors and prints the leave-one-deployment-out table.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.common import add_json_option, format_table
from pdcluster.planner.published import table_text, validate


def breakdown_table(result: dict, top: int = 6) -> str:
    """Per row: the step's compute / communication / hidden / host milliseconds and its costliest ops."""
    rows = []
    for r in result["rows"]:
        b = r["breakdown"]
        ops = ", ".join(f"{name} {ms:.2f}" for name, ms in list(b["op_ms"].items())[:top])
        rows.append(
            (r["id"], b["total_ms"], b["compute_ms"], b["comm_ms"], b["hidden_comm_ms"], b["host_ms"], ops)
        )
    header = (
        "row",
        "step ms",
        "compute ms",
        "comm ms",
        "hidden ms",
        "host ms",
        f"top {top} ops (ms per step)",
    )
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.planner_published", description=__doc__.splitlines()[0]
    )
    add_json_option(parser)
    parser.add_argument("--breakdown", action="store_true", help="also print each row's op breakdown")
    parser.add_argument(
        "--fit", action="store_true", help="refit the fitted factors; leave-one-deployment-out"
    )
    args = parser.parse_args(argv)
    result = {"benchmark": "planner_published", **validate()}
    if args.fit:
        from pdcluster.planner.fit import fit, leave_one_out

        result["refit"] = fit()
        result["leave_one_out"] = leave_one_out()
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(table_text(result) + "\n")
    if args.breakdown:
        sys.stdout.write("\n" + breakdown_table(result) + "\n")
    if args.fit:
        from pdcluster.planner.fit import loo_text

        sys.stdout.write("\n" + loo_text(result["refit"], result["leave_one_out"]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
