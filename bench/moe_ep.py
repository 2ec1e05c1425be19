"""Expert-parallel decode step on CPU: `python -m bench.moe_ep [--json]`.

For each EP size (1, 2, 4: that many spawned processes joined in one gloo group on 127.0.0.1, as
`engine.parallel.make_instance_group` makes them) and each model (the bundled tiny model: 8 routed
experts, top-2; `moe64`: the same architecture with random weights, 64 routed experts, top-8, 8 groups),
every rank runs the main-layer forward of a decode batch of `batch` requests (data-parallel attention:
each rank its own batch, each request `--context-len` tokens of KV) through `engine.model_runner`, with
its share of the routed experts behind an `EPDispatcher` (EP 1: a group of one). Per step it reports:

    step_ms        the forward (main layers; no sampling, no MTP), mean over timed steps, slowest rank
    dispatch_ms    counts exchange + all-to-all of token rows (includes waiting for the other ranks)
    expert_ms      the rank's local experts
    combine_ms     all-to-all back + weighted sum
    attention_ms   the rest: attention, dense layers, norms, router, shared expert (step - the three)
    bytes_per_step token-row bytes a rank sent to other ranks (dispatch + combine), mean over ranks,
                   against the analytic count under uniform routing:
                   2 * batch * top_k * (ep - 1) / ep * hidden_size * itemsize * num_moe_layers

Imbalance (max/mean rows per rank, over all MoE layers) under skewed routing: each MoE layer's router
gets `e_score_correction_bias = --skew * (1 - e / n)` (low-numbered experts chosen more), the default
placement runs `--num-steps` steps, then EPLB (`ExpertParallelRuntime.rebalance`, weights moved over the
group) places `--num-redundant-experts` replicas from that load, and the same steps run again.

`overlap_step_ms`: the step at the last `--batches` size with two-micro-batch overlap off and on
(`EPDispatcher.forward`), the same inputs one after the other. Figures on a shared machine are contended:
compare the EP sizes and variants of one run with each other, not with other runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import environment, format_table, int_list, main_with, new_parser
from pdcluster.engine.expert_parallel import ExpertParallelRuntime
from pdcluster.engine.local_ranks import run_ranks
from pdcluster.engine.model_runner import ModelRunner, build_model_input
from pdcluster.engine.parallel import ParallelConfig, make_instance_group
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.expert_placement import ExpertPlacement, moe_layer_indices
from pdcluster.models.loader import load_checkpoint, save_checkpoint

TIMEOUT_S = 120.0


def moe64_checkpoint(bundled: Path, out_dir: Path) -> Path:
    """A random-weight checkpoint: the bundled architecture with 64 routed experts, top-8, 8 groups."""
    config = load_checkpoint(bundled).config
    config = dataclasses.replace(config, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4)
    torch.manual_seed(0)
    save_checkpoint(DeepseekV3ForCausalLM(config), out_dir)
    return out_dir


def decode_batch(runner: ModelRunner, batch: int, context_len: int, seed: int):
    """A decode step of `batch` requests, each at position `context_len - 1` with its own blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = -(-context_len // runner.block_size)
    vocab = runner.config.vocab_size
    return build_model_input(
        [[int(torch.randint(vocab, (1,), generator=gen))] for _ in range(batch)],
        [context_len - 1] * batch,
        [list(range(r * blocks_per_req, (r + 1) * blocks_per_req)) for r in range(batch)],
        runner.block_size,
    )


def timed_steps(
    runner: ModelRunner, runtime: ExpertParallelRuntime, inputs, num_steps: int
) -> dict[str, float]:
    """Run `num_steps` forwards; mean seconds and bytes per step from the runtime's totals."""
    before = runtime.stats()
    start_s = time.perf_counter()
    for _ in range(num_steps):
        runner.forward(inputs)
        runtime.end_step(stepped=True, was_idle=False)
    wall_s = time.perf_counter() - start_s
    after = runtime.stats()

    def per_step(name: str) -> float:
        return (getattr(after, name) - getattr(before, name)) / num_steps

    return {
        "step_s": wall_s / num_steps,
        "dispatch_s": per_step("dispatch_s"),
        "expert_s": per_step("expert_s"),
        "combine_s": per_step("combine_s"),
        "bytes": per_step("dispatch_bytes") + per_step("combine_bytes"),
    }


def rank_main(rank: int, world_size: int, port: int, spec: dict[str, Any]) -> dict[str, Any]:
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    group = make_instance_group("127.0.0.1", port, rank, world_size, timeout_s=TIMEOUT_S)
    out: dict[str, Any] = {}
    for name, path in spec["models"].items():
        config = load_checkpoint(path).config  # (a tiny model: reading it twice is cheap)
        num_layers, n = len(moe_layer_indices(config)), config.n_routed_experts
        redundant = spec["num_redundant_experts"] if world_size > 1 else 0
        placement = ExpertPlacement.default(num_layers, n, world_size, redundant)
        model = load_checkpoint(path, placement=placement, ep_rank=rank)
        parallel = ParallelConfig(world_size, rank, num_redundant_experts=redundant)
        runtime = ExpertParallelRuntime(model, parallel, group, placement)
        context = spec["context_len"]
        runner = ModelRunner(model, max(spec["batches"]) * -(-context // 16), 16)
        rows = []
        for batch in spec["batches"]:
            inputs = decode_batch(runner, batch, context, seed=1000 * rank + batch)
            timed_steps(runner, runtime, inputs, spec["num_warmup_steps"])
            rows.append({"batch": batch, **timed_steps(runner, runtime, inputs, spec["num_steps"])})
        # two-micro-batch overlap at the last batch size: off then on, the same inputs, side by side
        overlap = {}
        for enabled in (False, True):
            runtime.set_micro_batch_overlap(enabled)
            timed_steps(runner, runtime, inputs, spec["num_warmup_steps"])
            overlap[str(enabled).lower()] = timed_steps(runner, runtime, inputs, spec["num_steps"])["step_s"]
        runtime.set_micro_batch_overlap(False)
        # skewed routing, default placement, then EPLB
        for moe in runtime.moe:
            moe.gate.e_score_correction_bias.copy_(spec["skew"] * (1 - torch.arange(n) / n))
        inputs = decode_batch(runner, max(spec["batches"]), context, seed=7 + rank)
        runtime.reset_window()
        timed_steps(runner, runtime, inputs, spec["num_steps"])
        before = runtime.stats().total_imbalance
        runtime.rebalance()
        timed_steps(runner, runtime, inputs, spec["num_steps"])
        stats = runtime.stats()
        out[name] = {
            "rows": rows,
            "overlap_step_s": overlap,
            "imbalance_default": before,
            "imbalance_eplb": stats.total_imbalance,
            "rebalance_s": stats.last_rebalance_s,
            "rebalance_moved_bytes": stats.rebalance_moved_bytes,
            "hidden_size": config.hidden_size,
            "itemsize": next(model.parameters()).dtype.itemsize,
            "top_k": config.num_experts_per_tok,
            "num_moe_layers": len(moe_layer_indices(config)) - config.num_nextn_predict_layers,
            "num_physical_experts": placement.num_physical_experts,
        }
    return out


def summarize(per_rank: dict[int, dict[str, Any]], ep: int) -> dict[str, Any]:
    """Per model: per batch the slowest rank's step and the mean of the parts over ranks."""
    result = {}
    for name, first in per_rank[0].items():
        rows = []
        for i, row in enumerate(first["rows"]):
            ranks = [per_rank[r][name]["rows"][i] for r in range(ep)]

            def mean_ms(key: str, ranks=ranks) -> float:
                return round(1e3 * sum(x[key] for x in ranks) / ep, 3)

            step_ms = round(1e3 * max(x["step_s"] for x in ranks), 3)
            parts = {k: mean_ms(f"{k}_s") for k in ("dispatch", "expert", "combine")}
            analytic = (
                2 * row["batch"] * first["top_k"] * (ep - 1) / ep * first["hidden_size"] * first["itemsize"]
            ) * first["num_moe_layers"]
            rows.append(
                {
                    "batch": row["batch"],
                    "step_ms": step_ms,
                    **{f"{k}_ms": v for k, v in parts.items()},
                    "attention_ms": round(mean_ms("step_s") - sum(parts.values()), 3),
                    "bytes_per_step": round(sum(x["bytes"] for x in ranks) / ep),
                    "analytic_bytes_per_step": round(analytic),
                }
            )
        overlap = {
            key: round(1e3 * max(per_rank[r][name]["overlap_step_s"][key] for r in range(ep)), 3)
            for key in ("false", "true")
        }
        result[name] = {
            "rows": rows,
            "overlap_step_ms": {
                "batch": first["rows"][-1]["batch"],
                "off": overlap["false"],
                "on": overlap["true"],
            },
            "num_physical_experts": first["num_physical_experts"],
            "imbalance_default": round(first["imbalance_default"], 4),
            "imbalance_eplb": round(first["imbalance_eplb"], 4),
            "rebalance_ms": round(1e3 * max(per_rank[r][name]["rebalance_s"] for r in range(ep)), 3),
        }
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": str(args.model)}
        if not args.skip_moe64:
            models["moe64"] = str(moe64_checkpoint(args.model, Path(tmp) / "moe64"))
        spec = {
            "models": models,
            "batches": args.batches,
            "context_len": args.context_len,
            "num_steps": args.num_steps,
            "num_warmup_steps": args.num_warmup_steps,
            "num_redundant_experts": args.num_redundant_experts,
            "skew": args.skew,
            "threads": args.threads or 1,
        }
        by_ep = {}
        for ep in args.ep:
            by_ep[str(ep)] = summarize(run_ranks(rank_main, ep, spec, timeout_s=20 * TIMEOUT_S), ep)
    config = environment(args.model)
    config.update({k: v for k, v in spec.items() if k != "models"})
    return {"config": config, "results": by_ep}


def table(result: dict[str, Any]) -> str:
    rows = []
    for ep, models in result["results"].items():
        for name, res in models.items():
            for r in res["rows"]:
                rows.append(
                    [ep, name, r["batch"], r["step_ms"], r["attention_ms"], r["dispatch_ms"], r["expert_ms"]]
                    + [r["combine_ms"], r["bytes_per_step"], r["analytic_bytes_per_step"]]
                    + [res["imbalance_default"], res["imbalance_eplb"]]
                )
    header = ["ep", "model", "batch", "step_ms", "attn+rest", "dispatch", "expert", "combine", "bytes"]
    lines = [format_table(header + ["analytic", "imb_default", "imb_eplb"], rows), ""]
    for ep, models in result["results"].items():
        for name, res in models.items():
            o = res["overlap_step_ms"]
            lines.append(f"ep {ep} {name} batch {o['batch']}: overlap off {o['off']} ms, on {o['on']} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = new_parser("bench.moe_ep", __doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int_list, default=[1, 2, 4], help="EP sizes (default %(default)s)")
    parser.add_argument("--batches", type=int_list, default=[1, 8, 64], help="decode batch per rank")
    parser.add_argument("--context-len", type=int, default=64, help="KV tokens per request (default 64)")
    parser.add_argument("--num-steps", type=int, default=10, help="timed steps per batch (default 10)")
    parser.add_argument("--num-warmup-steps", type=int, default=2)
    parser.add_argument("--num-redundant-experts", type=int, default=4, help="EPLB replicas (default 4)")
    parser.add_argument("--skew", type=float, default=0.3, help="router bias skew for the imbalance runs")
    parser.add_argument("--skip-moe64", action="store_true", help="only the bundled model")
    return main_with(parser, argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
