"""The performance model against published DeepSeek-V3/R1 deployments (`pdcluster plan --validate`).

`data/published_deployments.json` holds each deployment's shape and rows (operating point, published
figures, source, named assumptions). Decode: TPOT = step / (1 + a) at MTP acceptance a; prefill
throughput per device counts all `prompt_len` tokens, cache hits included (as DeepSeek's Day 6 figure).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcluster.config.hardware import get_accelerator
from pdcluster.models.config import DeepseekV3Config
from pdcluster.planner.comm_costs import Link
from pdcluster.planner.efficiency import Efficiency, Factor, get_efficiency
from pdcluster.planner.op_costs import Dtypes
from pdcluster.planner.perf_model import Parallelism, PerfModel
from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape

DATA = Path(__file__).resolve().parent / "data"
TABLE_PATH = DATA / "published_deployments.json"
CONFIG_PATH = DATA / "deepseek-v3.config.json"
WITHIN = 0.15


@dataclass(frozen=True)
class Deployment:
    """One published deployment shape (`devices` per instance). `microbatch_overlap`: True (two micro-batches
    where faster), False, or "always"; `host_overhead`: its own per-step host time, if published."""

    key: str
    name: str
    accelerator: str
    devices: int
    expert_parallel_size: int
    num_redundant_experts: int
    dtypes: Dtypes
    ep_link: Link
    dispatch_dtype: str
    combine_dtype: str
    microbatch_overlap: bool | str
    node_forwarding: tuple[int, Link] | None
    facts: tuple[str, ...]
    host_overhead: Factor | None = None


def _link(d: dict[str, Any]) -> Link:
    return Link(float(d["bandwidth_bytes_per_s"]), float(d["latency_s"]), d["level"])


def load_table(path: Path = TABLE_PATH) -> tuple[dict[str, Deployment], list[dict[str, Any]]]:
    """`(deployments by key, rows)` of the published table at `path`. Raises ValueError for a row naming an
    unknown deployment or kind, or a missing field (named)."""
    raw = json.loads(Path(path).read_text())
    deployments = {}
    for key, d in raw["deployments"].items():
        try:
            forwarding, host, overlap = (
                d["node_forwarding"],
                d.get("host_overhead_s"),
                d["microbatch_overlap"],
            )
            if overlap not in (True, False, "always"):
                raise ValueError(
                    f"{path}: deployment {key!r}: microbatch_overlap {overlap!r} is not true, false or always"
                )
            deployments[key] = Deployment(
                key, d["name"], d["accelerator"], int(d["devices"]), int(d["expert_parallel_size"]),
                int(d["num_redundant_experts"]), Dtypes(**d["dtypes"]), _link(d["ep_link"]),
                d["dispatch_dtype"], d["combine_dtype"], overlap,
                None if forwarding is None
                else (int(forwarding["devices_per_node"]), _link(forwarding["link"])),
                tuple(d["facts"]), None if host is None else Factor(float(host["value"]), host["source"]),
            )  # fmt: skip
        except KeyError as exc:
            raise ValueError(f"{path}: deployment {key!r} has no field {exc}") from None
    rows = raw["rows"]
    for row in rows:
        if row.get("deployment") not in deployments or row.get("kind") not in ("decode", "prefill"):
            raise ValueError(f"{path}: row {row.get('id')!r}: unknown deployment or kind")
    return deployments, rows


def load_config() -> DeepseekV3Config:
    return DeepseekV3Config.from_json_file(CONFIG_PATH)


def model_for(
    dep: Deployment,
    config: DeepseekV3Config,
    efficiency: Efficiency | None = None,
    *,
    ep_imbalance: float | None = None,
    overlap: bool | None = None,
) -> PerfModel:
    """The deployment's `PerfModel` (or with `efficiency`); `overlap` overrides its overlap."""
    spec = get_accelerator(dep.accelerator)
    if dep.host_overhead is not None:
        efficiency = dataclasses.replace(
            efficiency or get_efficiency(spec.name), host_overhead_s=dep.host_overhead
        )
    return PerfModel(
        config,
        spec,
        efficiency,
        dtypes=dep.dtypes,
        parallel=Parallelism(dep.devices, 1, dep.expert_parallel_size, dep.num_redundant_experts),
        ep_link=dep.ep_link,
        kv_link=dep.ep_link,
        dispatch_dtype=dep.dispatch_dtype,
        combine_dtype=dep.combine_dtype,
        microbatch_overlap=dep.microbatch_overlap if overlap is None else overlap,
        ep_imbalance=ep_imbalance,
        mtp_in_prefill=True,
        node_forwarding=dep.node_forwarding,
    )


def row_step(model: PerfModel, kind: str, point: dict[str, Any]) -> StepShape:
    """The one instance step a row's operating point prices."""
    n = model.parallel.devices
    if kind == "decode":
        rows = (DecodeRow(point["context_len"], 1 + point["k"]),) * (point["batch"] * n)
        return StepShape(decode=rows, num_speculative_tokens=point["k"])
    chunk = PrefillChunk(point["prompt_len"] - point.get("cached", 0), point.get("cached", 0))
    return StepShape(prefill=(chunk,) * (point["prompts"] * n))


def predict(model: PerfModel, kind: str, point: dict[str, Any]) -> dict[str, float]:
    """Step time (ms) and the row's published quantities at `point`."""
    step_s = model.step_time_s(row_step(model, kind, point))
    if kind == "decode":
        tokens_per_step = 1 + (point["acceptance"] if point["k"] else 0.0)
        return {"step_ms": step_s * 1e3, "tpot_ms": step_s / tokens_per_step * 1e3,
                "tokens_per_s_per_device": point["batch"] * tokens_per_step / step_s}  # fmt: skip
    return {
        "step_ms": step_s * 1e3,
        "tokens_per_s_per_device": point["prompts"] * point["prompt_len"] / step_s,
    }


def breakdown_ms(model: PerfModel, step: StepShape) -> dict[str, Any]:
    """`PerfModel.breakdown` of `step` in milliseconds."""
    b = model.breakdown(step)
    return {"op_ms": {k: round(v * 1e3, 3) for k, v in sorted(b.op_s.items(), key=lambda kv: -kv[1])},
            "compute_ms": round(b.compute_s * 1e3, 3), "comm_ms": round(b.comm_s * 1e3, 3),
            "hidden_comm_ms": round(b.hidden_comm_s * 1e3, 3), "host_ms": round(b.host_s * 1e3, 3),
            "total_ms": round(b.total_s * 1e3, 3)}  # fmt: skip


def evaluate(
    config: DeepseekV3Config | None = None,
    efficiency: dict[str, Efficiency] | None = None,
    path: Path = TABLE_PATH,
) -> list[dict[str, Any]]:
    """Every row predicted and compared; `factors` per accelerator replace the catalog's."""
    config = config or load_config()
    deployments, rows = load_table(path)
    out = []
    for row in rows:
        dep, point, kind = deployments[row["deployment"]], row["point"], row["kind"]
        eff = (efficiency or {}).get(dep.accelerator)
        model = model_for(dep, config, eff, ep_imbalance=row.get("ep_imbalance"))
        pred = predict(model, kind, point)
        serial = predict(
            model_for(dep, config, eff, ep_imbalance=row.get("ep_imbalance"), overlap=False), kind, point
        )
        checks = {}
        for quantity, published in row["published"].items():
            error = pred[quantity] / published - 1.0
            checks[quantity] = {"published": round(published, 2), "predicted": round(pred[quantity], 2),
                                "error": round(error, 4), "within_15pct": abs(error) <= WITHIN,
                                "no_overlap_predicted": round(serial[quantity], 2)}  # fmt: skip
        out.append({"id": row["id"], "deployment": dep.key, "point": point,
                    "predicted": {k: round(v, 3) for k, v in pred.items()}, "checks": checks,
                    "breakdown": breakdown_ms(model, row_step(model, kind, point)),
                    "source": row["source"]})  # fmt: skip
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`{checks, within_15pct, max_abs_error (fraction), beyond_25pct}` over every published quantity."""
    errors = [c["error"] for r in rows for c in r["checks"].values()]
    return {
        "checks": len(errors),
        "within_15pct": sum(abs(e) <= WITHIN for e in errors),
        "beyond_25pct": sum(abs(e) > 0.25 for e in errors),
        "max_abs_error": round(max((abs(e) for e in errors), default=0.0), 4),
    }


def validate(path: Path = TABLE_PATH) -> dict[str, Any]:
    """The `--validate` result: `{rows, summary, deployments, fitted}` (`planner.fit.fitted_factors`)."""
    from pdcluster.planner.fit import fitted_factors

    rows = evaluate(path=path)
    deployments, _ = load_table(path)
    return {
        "rows": rows,
        "summary": summary(rows),
        "fitted": fitted_factors(),
        "deployments": {k: {"name": d.name, "facts": list(d.facts)} for k, d in deployments.items()},
    }


def table_text(result: dict[str, Any]) -> str:
    """Predicted, published and error per row, then the summary line."""
    header = ("row", "quantity", "published", "predicted", "error", "within 15%", "no overlap")
    lines = [header]
    for r in result["rows"]:
        for quantity, c in r["checks"].items():
            lines.append((r["id"], quantity, f"{c['published']:.2f}", f"{c['predicted']:.2f}",
                          f"{c['error'] * 100:+.1f}%", "met" if c["within_15pct"] else "not met",
                          f"{c['no_overlap_predicted']:.2f}"))  # fmt: skip
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    text = "\n".join("  ".join(str(v).rjust(w) for v, w in zip(line, widths, strict=True)) for line in lines)
    s = result["summary"]
    return text + (
        f"\n\n{s['within_15pct']} of {s['checks']} checks within 15%, {s['beyond_25pct']} beyond 25%, "
        f"max |error| {s['max_abs_error'] * 100:.1f}%"
    )
