"""The performance model against published DeepSeek-V3/R1 deployments: `python -m bench.planner_published`.

Every prediction is made from published specs only: the public DeepSeek-V3 config, the hardware catalog
(`orchestrator.hardware`: vendor peaks) and its efficiency factors (`orchestrator.efficiency`: vendor
figures and published microbenchmarks, each with its source; none fitted to the figures below), and each
deployment's published shape (parallelism, dtypes, batch, lengths, MTP). Each row is a published figure,
the model's prediction at the same operating point, and whether it lies within 15%.

Operating points (what `predict_decode` / `predict_prefill` price):
* decode: `batch` requests per device at KV length `context_len`, each step verifying `1 + k` tokens;
  with MTP acceptance `a`, a step yields `1 + a` tokens per request (k = 1), so
  TPOT = step time / (1 + a) and throughput per device = batch x (1 + a) / step time.
* prefill: `prompts` prompts per device per step of `prompt_len` tokens of which `cached` hit a prefix
  cache (computed: `prompt_len - cached` tokens over `cached` context); throughput per device counts all
  `prompt_len` tokens when the publication counts cache hits (DeepSeek's Day 6 figure does).

Facts and their sources are in `DEPLOYMENTS` and `ROWS`; what a publication leaves unstated (DeepSeek's
prompt length, KV cache dtype, MTP acceptance) is an assumption named in the row.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import format_table
from pdcluster.models.config import DeepseekV3Config
from pdcluster.orchestrator.hardware import get_accelerator
from pdcluster.planner.op_costs import Dtypes
from pdcluster.planner.perf_model import Link, Parallelism, PerfModel
from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape

CONFIG_PATH = Path(__file__).resolve().parents[1] / "clusters" / "models" / "deepseek-v3.config.json"
WITHIN = 0.15

DAY6 = (
    "DeepSeek, 'Day 6: DeepSeek-V3/R1 Inference System Overview' (github.com/deepseek-ai/open-infra-index, "
    "202502OpenSourceWeek), 2025-03-01"
)
RTP = "RTP-LLM DeepSeek Reproduce Tech Report (alibaba/rtp-llm docs), same H800 EP32 prefill / EP144 decode"
CM = "Zuo et al., 'Serving Large Language Models on Huawei CloudMatrix384', arXiv:2506.12708 (2025)"


@dataclass(frozen=True)
class Deployment:
    """One published deployment shape. `devices` per instance; per-device figures are per GPU or per 910C
    die (the paper's "NPU" is a 2-die package: its per-NPU figures are divided by 2 here)."""

    name: str
    accelerator: str
    devices: int
    expert_parallel_size: int
    num_redundant_experts: int
    dtypes: Dtypes
    ep_link: Link
    dispatch_dtype: str
    combine_dtype: str
    microbatch_overlap: bool
    facts: tuple[str, ...] = field(default=())
    node_forwarding: tuple[int, Link] | None = None


H800_IB = Link(50e9, 5e-6, "inter_node")  # one 400 Gb/s CX7 NIC per GPU (DeepEP README: ~50 GB/s)
H800_NVLINK = Link(160e9, 2e-6, "intra_node")  # DeepEP README: ~160 GB/s NVLink per H800
UB = Link(196e9, 3e-6, "supernode")  # UB ~196 GB/s per die one way (arXiv:2506.12708; clusters/cm384.yaml)
FP8 = Dtypes("fp8", "bfloat16", "bfloat16")
INT8 = Dtypes("int8", "bfloat16", "int8")

DEPLOYMENTS = {
    "h800-decode": Deployment(
        "DeepSeek H800 decode (EP144, DP144 attention)",
        "h800",
        144,
        144,
        32,
        FP8,
        H800_IB,
        "fp8",
        "bfloat16",
        True,
        (
            f"{DAY6}: decode units of 18 nodes x 8 H800, routed experts EP144, MLA and shared expert DP144, "
            "32 redundant experts (2 routed + 1 shared per GPU); FP8 matmuls and dispatch, BF16 MLA and "
            "combine; dual micro-batch overlap",
            "KV cache dtype not published: bf16 assumed (FlashMLA's)",
        ),
    ),
    "h800-prefill": Deployment(
        "DeepSeek H800 prefill (EP32, DP32 attention)",
        "h800",
        32,
        32,
        32,
        FP8,
        H800_IB,
        "fp8",
        "bfloat16",
        True,
        (
            f"{DAY6}: prefill units of 4 nodes, routed experts EP32, MLA and shared expert DP32, 32 "
            "redundant experts (9 routed + 1 shared per GPU); dual micro-batch overlap",
            "EP traffic as DeepEP's normal kernels move it: once per destination node over IB, then "
            "NVLink (DeepEP README; DeepSeek-V3 report, section 3.2.2)",
        ),
        node_forwarding=(8, H800_NVLINK),
    ),
    "cm-decode": Deployment(
        "CloudMatrix-Infer decode (EP320, 160 NPUs = 320 dies)",
        "ascend-910c",
        320,
        320,
        64,
        INT8,
        UB,
        "int8",
        "bfloat16",
        True,
        (
            f"{CM}: decode over 160 NPUs (320 dies), one expert per die (EP320), INT8 weights "
            "and activations, microbatch pipeline, MTP k=1 with 70% acceptance",
            "here the 64 non-routed dies are modelled as redundant experts, the shared expert "
            "replicated on every die; KV cache int8 as clusters/cm384.yaml",
        ),
    ),
    "cm-prefill": Deployment(
        "CloudMatrix-Infer prefill (EP32, 16 NPUs = 32 dies)",
        "ascend-910c",
        32,
        32,
        32,
        INT8,
        UB,
        "int8",
        "bfloat16",
        True,
        (f"{CM}: prefill instances of 16 NPUs (32 dies), EP32, INT8, microbatch pipeline",),
    ),
}


def model_for(
    dep: Deployment,
    config: DeepseekV3Config,
    *,
    ep_imbalance: float | None = None,
    overlap: bool | None = None,
) -> PerfModel:
    """The deployment's `PerfModel` (catalog efficiency of its accelerator); `overlap` overrides the
    deployment's micro-batch overlap (the sensitivity rows)."""
    return PerfModel(
        config,
        get_accelerator(dep.accelerator),
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


def predict_decode(
    model: PerfModel, batch: int, context_len: int, k: int, acceptance: float
) -> dict[str, float]:
    """Step time, TPOT and throughput per device at `batch` requests per device (module docstring)."""
    rows = (DecodeRow(context_len, 1 + k),) * (batch * model.parallel.devices)
    step_s = model.step_time_s(StepShape(decode=rows, num_speculative_tokens=k))
    tokens_per_step = 1 + (acceptance if k else 0.0)
    return {"step_ms": step_s * 1e3, "tpot_ms": step_s / tokens_per_step * 1e3,
            "tokens_per_s_per_device": batch * tokens_per_step / step_s}  # fmt: skip


def predict_prefill(model: PerfModel, prompts: int, prompt_len: int, cached: int = 0) -> dict[str, float]:
    """Step time and prompt tokens per second per device (cache hits counted) at `prompts` per device."""
    chunk = PrefillChunk(prompt_len - cached, cached)
    step_s = model.step_time_s(StepShape(prefill=(chunk,) * (prompts * model.parallel.devices)))
    return {"step_ms": step_s * 1e3, "tokens_per_s_per_device": prompts * prompt_len / step_s}


# (row id, deployment, kind, operating point, published {quantity: value}, source and notes)
ROWS: tuple[dict[str, Any], ...] = (
    {"id": "deepseek-decode", "deployment": "h800-decode", "kind": "decode",
     "point": {"batch": 88, "context_len": 4989, "k": 1, "acceptance": 0.85},
     "published": {"tokens_per_s_per_device": 14_800 / 8, "tpot_ms": 1000 / 21},
     "source": f"{DAY6}: ~14.8k output tok/s per node, 20-22 tok/s per user, average KV length per output "
               "token 4,989. Batch per GPU not published: Little's law 1,850 x (1/21 s) = 88. MTP k=1 at "
               "0.85 acceptance assumed (DeepSeek-V3 report, arXiv:2412.19437, section 5.4.3: 85-90%)"},
    {"id": "rtp-llm-decode", "deployment": "h800-decode", "kind": "decode",
     "point": {"batch": 92, "context_len": 5120, "k": 1, "acceptance": 0.85},
     "published": {"tokens_per_s_per_device": 1850, "tpot_ms": 50.0},
     "source": f"{RTP}: 13,200 concurrent requests on 144 GPUs (92 per GPU) at the 20 tok/s per user SLA: "
               "1,850 tok/s per GPU; 4K input / 2K output (mean KV 4K + 1K). MTP on (acceptance not "
               "published; 0.85 assumed as above)"},
    {"id": "rtp-llm-decode-low", "deployment": "h800-decode", "kind": "decode",
     "point": {"batch": 1, "context_len": 5120, "k": 1, "acceptance": 0.85},
     "published": {"tpot_ms": 1000 / 42},
     "source": f"{RTP}: 'at low concurrency one user reaches 42 TPS'; the concurrency is not published "
               "(1 request per GPU here)"},
    {"id": "deepseek-prefill", "deployment": "h800-prefill", "kind": "prefill",
     "point": {"prompts": 4, "prompt_len": 4096, "cached": 2306},
     "published": {"tokens_per_s_per_device": 73_700 / 8},
     "source": f"{DAY6}: ~73.7k input tok/s per node including cache hits; 56.3% of input tokens hit the "
               "on-disk KV cache. Prompt length and batch not published: 4 prompts of 4,096 tokens per GPU "
               "per step (DeepSeek's profile-data prefill setting: 4K prompts, 16K tokens per GPU), 56.3% "
               "(2,306 tokens) of each cached"},
    {"id": "rtp-llm-prefill", "deployment": "h800-prefill", "kind": "prefill",
     "point": {"prompts": 2, "prompt_len": 4096, "cached": 0},
     "published": {"tokens_per_s_per_device": 5333, "step_ms": 1500},
     "source": f"{RTP}: one GPU runs 2 x 4K requests in 1.5 s under full load: 5,333 tok/s per GPU, "
               "no cache"},
    *({"id": f"cloudmatrix-decode-b{b}-{i}-{o}", "deployment": "cm-decode", "kind": "decode",
       "point": {"batch": b // 2, "context_len": i + o // 2, "k": 1, "acceptance": 0.7},
       "published": {"tokens_per_s_per_device": tps / 2, "tpot_ms": tpot},
       "source": f"{CM}: decode {i}/{o} input/output tokens, batch {b} per NPU (= {b // 2} per die), TPOT "
                 f"{tpot} ms, {tps:,} tok/s per NPU (= {tps / 2:,.1f} per die); mean KV {i} + {o}/2"}
      for b, i, o, tpot, tps in ((96, 4096, 256, 49.4, 1943), (24, 4096, 256, 24.6, 974),
                                 (8, 4096, 256, 14.9, 538), (128, 1024, 1024, 46.8, 2733),
                                 (112, 2048, 256, 47.4, 2360))),
    {"id": "cloudmatrix-prefill", "deployment": "cm-prefill", "kind": "prefill",
     "point": {"prompts": 2, "prompt_len": 4096, "cached": 0},
     "published": {"tokens_per_s_per_device": 5655 / 2},
     "source": f"{CM}: 4K prompts, 16,384 tokens per NPU per batch (2 x 4K per die): 5,655 tok/s per NPU "
               "measured (= 2,827.5 per die); EP imbalance from the model's statistical estimate"},
    {"id": "cloudmatrix-prefill-balanced", "deployment": "cm-prefill", "kind": "prefill", "ep_imbalance": 1.0,
     "point": {"prompts": 2, "prompt_len": 4096, "cached": 0},
     "published": {"tokens_per_s_per_device": 6688 / 2},
     "source": f"{CM}: 6,688 tok/s per NPU projected under perfect expert balancing (ep_imbalance 1 here)"},
)  # fmt: skip


def row_step(model: PerfModel, kind: str, point: dict[str, Any]) -> StepShape:
    """The one instance step `predict_decode` / `predict_prefill` price at `point`."""
    n = model.parallel.devices
    if kind == "decode":
        rows = (DecodeRow(point["context_len"], 1 + point["k"]),) * (point["batch"] * n)
        return StepShape(decode=rows, num_speculative_tokens=point["k"])
    chunk = PrefillChunk(point["prompt_len"] - point.get("cached", 0), point.get("cached", 0))
    return StepShape(prefill=(chunk,) * (point["prompts"] * n))


def breakdown_ms(model: PerfModel, step: StepShape) -> dict[str, Any]:
    """`PerfModel.breakdown` of `step` in milliseconds: per op (summed over layers), compute,
    communication (EP dispatch + combine), host, total, and the compute-bound ops."""
    b = model.breakdown(step)
    return {"op_ms": {k: round(v * 1e3, 3) for k, v in sorted(b.op_s.items(), key=lambda kv: -kv[1])},
            "compute_ms": round(b.compute_s * 1e3, 3), "comm_ms": round(b.comm_s * 1e3, 3),
            "host_ms": round(b.host_s * 1e3, 3), "total_ms": round(b.total_s * 1e3, 3),
            "compute_bound_ops": sorted(set(b.compute_bound_ops))}  # fmt: skip


def evaluate(config: DeepseekV3Config) -> list[dict[str, Any]]:
    """Every row of `ROWS` predicted and compared."""
    out = []
    for row in ROWS:
        dep, point = DEPLOYMENTS[row["deployment"]], row["point"]
        predict = predict_decode if row["kind"] == "decode" else predict_prefill
        model = model_for(dep, config, ep_imbalance=row.get("ep_imbalance"))
        pred = predict(model, **point)
        # Sensitivity, not the prediction: the same point with communication not hidden behind compute.
        serial = predict(model_for(dep, config, ep_imbalance=row.get("ep_imbalance"), overlap=False), **point)
        checks = {}
        for quantity, published in row["published"].items():
            error = pred[quantity] / published - 1.0
            checks[quantity] = {"published": round(published, 2), "predicted": round(pred[quantity], 2),
                                "error": round(error, 4), "within_15pct": abs(error) <= WITHIN,
                                "no_overlap_predicted": round(serial[quantity], 2)}  # fmt: skip
        out.append({"id": row["id"], "deployment": DEPLOYMENTS[row["deployment"]].name, "point": point,
                    "predicted": {k: round(v, 3) for k, v in pred.items()}, "checks": checks,
                    "breakdown": breakdown_ms(model, row_step(model, row["kind"], point)),
                    "source": row["source"]})  # fmt: skip
    return out


def table(result: dict[str, Any]) -> str:
    rows = []
    for r in result["rows"]:
        for quantity, c in r["checks"].items():
            verdict = "met" if c["within_15pct"] else "not met"
            error = f"{c['error'] * 100:+.1f}%"
            rows.append(
                (r["id"], quantity, c["published"], c["predicted"], error, verdict, c["no_overlap_predicted"])
            )
    header = ("row", "quantity", "published", "predicted", "error", "within 15%", "no-overlap (sensitivity)")
    return format_table(header, rows)


def breakdown_table(result: dict[str, Any], top: int = 6) -> str:
    """Per row: the step's compute / communication / host milliseconds and its `top` costliest ops."""
    rows = []
    for r in result["rows"]:
        b = r["breakdown"]
        ops = ", ".join(f"{name} {ms:.2f}" for name, ms in list(b["op_ms"].items())[:top])
        rows.append((r["id"], b["total_ms"], b["compute_ms"], b["comm_ms"], b["host_ms"], ops))
    header = ("row", "step ms", "compute ms", "comm ms", "host ms", f"top {top} ops (ms per step)")
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.planner_published", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--breakdown", action="store_true", help="also print each row's op breakdown")
    args = parser.parse_args(argv)
    config = DeepseekV3Config.from_json_file(CONFIG_PATH)
    rows = evaluate(config)
    checks = [c for r in rows for c in r["checks"].values()]
    result = {
        "benchmark": "planner_published",
        "rows": rows,
        "summary": {"checks": len(checks), "within_15pct": sum(c["within_15pct"] for c in checks)},
        "deployments": {k: {"name": d.name, "facts": list(d.facts)} for k, d in DEPLOYMENTS.items()},
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(table(result) + "\n")
        if args.breakdown:
            sys.stdout.write("\n" + breakdown_table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
