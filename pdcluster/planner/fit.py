"""The performance model's fitted factors: each fitted on one published deployment, checked on the others.

Fitted by bisection on one row of `planner.published`: `routing_sigma` on cm-prefill (CloudMatrix-Infer's
throughput over perfect balance), `serving_fraction` on h800-decode (DeepSeek's TPOT),
`prefill_serving_fraction` on h800-prefill (RTP-LLM's step time). `leave_one_out` reports how they carry over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdcluster.planner.efficiency import EFFICIENCY, Efficiency, Factor
from pdcluster.planner.kernel_tables import tables_for
from pdcluster.planner.published import evaluate, load_config, load_table, model_for, predict, summary


@dataclass(frozen=True)
class FitSource:
    """Fit `factor` so that `row`'s predicted `quantity` equals the published one (with `over_row`: the
    ratio of the two rows' predictions equals the published ratio)."""

    factor: str
    deployment: str
    row: str
    quantity: str
    over_row: str | None = None


SHIPPED = (
    FitSource("routing_sigma", "cm-prefill", "cloudmatrix-prefill", "tokens_per_s_per_device",
              "cloudmatrix-prefill-balanced"),
    FitSource("serving_fraction", "h800-decode", "deepseek-decode", "tpot_ms"),
    FitSource("prefill_serving_fraction", "h800-prefill", "rtp-llm-prefill", "step_ms"),
)  # fmt: skip
ALTERNATIVES = (
    FitSource("serving_fraction", "cm-decode", "cloudmatrix-decode-b96-4096-256", "tpot_ms"),
    FitSource("prefill_serving_fraction", "cm-prefill", "cloudmatrix-prefill-balanced",
              "tokens_per_s_per_device"),
)  # fmt: skip
BOUNDS = {
    "routing_sigma": (0.0, 4.0),
    "serving_fraction": (0.05, 1.5),
    "prefill_serving_fraction": (0.05, 1.5),
}


def _efficiencies(values: dict[str, float]) -> dict[str, Efficiency]:
    """The catalog's factors of every device kind with kernel tables, `values` replacing some."""
    changes = {k: Factor(v, "being fitted") for k, v in values.items()}
    return {name: dataclasses.replace(eff, **changes) for name, eff in EFFICIENCY.items() if tables_for(name)}


def _residual(source: FitSource, values: dict[str, float], context) -> float:
    """Predicted over published, minus 1, for `source` at factor `values`."""
    config, deployments, rows = context
    effs = _efficiencies(values)

    def pred(row_id: str) -> tuple[float, float]:
        row = next(r for r in rows if r["id"] == row_id)
        dep = deployments[row["deployment"]]
        model = model_for(dep, config, effs[dep.accelerator], ep_imbalance=row.get("ep_imbalance"))
        return predict(model, row["kind"], row["point"])[source.quantity], row["published"][source.quantity]

    p, pub = pred(source.row)
    if source.over_row:
        q, qub = pred(source.over_row)
        p, pub = p / q, pub / qub
    return p / pub - 1.0


def _fit_one(source: FitSource, values: dict[str, float], context, iterations: int = 40) -> float:
    lo, hi = BOUNDS[source.factor]
    r_lo = _residual(source, {**values, source.factor: lo}, context)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        r_mid = _residual(source, {**values, source.factor: mid}, context)
        if (r_mid > 0) == (r_lo > 0):
            lo, r_lo = mid, r_mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def shipped_values() -> dict[str, float]:
    """The fitted factors as the catalog ships them (`planner.efficiency`)."""
    eff = EFFICIENCY["h800"]
    return {s.factor: getattr(eff, s.factor).value for s in SHIPPED}


def fit(sources: tuple[FitSource, ...] = SHIPPED, rounds: int = 3) -> dict[str, float]:
    """Fit `factor` so `row`'s predicted `quantity` (or ratio to `over_row`) equals the published."""
    context = (load_config(), *load_table())
    values = shipped_values()
    for _ in range(rounds):
        for source in sources:
            values[source.factor] = round(_fit_one(source, values, context), 4)
    return values


def leave_one_out() -> list[dict[str, Any]]:
    """Per fraction and deployment: the value fitted there, each deployment's errors with it."""
    out = []
    shipped = shipped_values()
    for source in (*SHIPPED[1:], *ALTERNATIVES):
        values = dict(shipped)
        values[source.factor] = round(_fit_one(source, values, (load_config(), *load_table())), 4)
        rows = evaluate(efficiency=_efficiencies(values))
        per_dep = {}
        for dep in sorted({r["deployment"] for r in rows}):
            per_dep[dep] = summary([r for r in rows if r["deployment"] == dep])
        out.append({"factor": source.factor, "fitted_on": source.deployment, "value": values[source.factor],
                    "by_deployment": per_dep})  # fmt: skip
    return out


def fitted_factors() -> dict[str, dict[str, Any]]:
    """The shipped fitted factors: value, the deployment and row each was fitted on, and its source text."""
    eff = EFFICIENCY["h800"]
    return {s.factor: {"value": getattr(eff, s.factor).value, "fitted_on": s.deployment, "row": s.row,
                       "source": getattr(eff, s.factor).source} for s in SHIPPED}  # fmt: skip


def loo_text(refit: dict[str, float], loo: list[dict[str, Any]]) -> str:
    """The refit values and the leave-one-deployment-out table as text."""
    lines = ["refit: " + ", ".join(f"{k} {v:g}" for k, v in refit.items()), "",
             "leave one deployment out: factor on deployment -> value; per deployment: within 15% / checks, "
             "max |error|"]  # fmt: skip
    for entry in loo:
        per = "; ".join(
            f"{dep} {s['within_15pct']}/{s['checks']}, {s['max_abs_error'] * 100:.1f}%"
            for dep, s in entry["by_deployment"].items()
        )
        lines.append(f"{entry['factor']} on {entry['fitted_on']} -> {entry['value']:g}: {per}")
    return "\n".join(lines)
