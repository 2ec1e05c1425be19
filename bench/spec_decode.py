"""MTP speculative decoding: tokens/s and acceptance for k = 0..3. `python -m bench.spec_decode [--json]`.

For each batch size b and each k (`num_speculative_tokens`), a fresh engine over the same weights generates
greedily (`ignore_eos`, `--max-tokens` each) for `--num-prompts` held-out prompts, b at a time: the b
requests of a group are added together and the engine steps until they finish. Every (b, k) first runs
one untimed warm-up group on other held-out prompts (so no timed prompt hits the prefix cache).

    output_tokens_per_s   all output tokens / wall time of the groups (prefill included)
    decode_tokens_per_s   tokens committed after every request of a group had its first token, over the
                          time from that moment to the group's end (the decode phase only)
    acceptance_rate       accepted / proposed draft tokens; per_position[i] for draft depth i+1
    tokens_per_decode_step  tokens a request commits per decode step it takes part in (1 + accepted drafts)

Greedy decoding makes every k produce the same tokens as k = 0; `outputs_match_k0` checks it.
The bundled checkpoint has one MTP module; k > 1 chains it (see engine.mtp_proposer).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import Contention, environment, format_table, int_list, main_with, new_parser, ratio


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "bench.spec_decode",
        "Output tokens/s (tokens per second of wall-clock time) and MTP draft acceptance rate "
        "(overall and per draft position) for k = num_speculative_tokens, greedy, on held-out prompts.",
    )
    parser.add_argument(
        "--ks",
        type=int_list,
        default="0,1,2,3",
        help="comma-separated draft token counts k to compare (must include 0); default: %(default)s",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int_list,
        default="1,8",
        help="comma-separated numbers of requests generated together; default: %(default)s",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=16,
        help="held-out prompts timed per configuration (models.prompts.heldout_def_prompts: mixed "
        "lengths); default: %(default)s",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="output tokens per request (ignore_eos, so every run generates exactly this many); "
        "default: %(default)s",
    )
    parser.add_argument(
        "--target-speedup",
        type=float,
        default=1.5,
        help="target: output tokens/s of k=1 over k=0 at batch 1 (a ratio); default: %(default)s",
    )
    return parser


def run_group(engine: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    """Add `prompts` together, step the engine until they finish; outputs and timings (seconds)."""
    request_ids = [engine.add_request(p, params) for p in prompts]
    num_tokens = dict.fromkeys(request_ids, 0)
    outputs: dict[str, Any] = {}
    num_steps = num_decode_steps = num_decode_request_steps = 0
    prefilled_s: float | None = None
    num_tokens_at_prefilled = 0
    start_s = time.perf_counter()
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        num_steps += 1
        if prefilled_s is not None:
            num_decode_steps += 1
        for out in step_outputs:
            if prefilled_s is not None and len(out.token_ids) > num_tokens[out.request_id]:
                num_decode_request_steps += 1  # a decode step of this request that committed tokens
            num_tokens[out.request_id] = len(out.token_ids)
            if out.finished:
                outputs[out.request_id] = out
        if prefilled_s is None and min(num_tokens.values()) > 0:
            prefilled_s = time.perf_counter()
            num_tokens_at_prefilled = sum(num_tokens.values())
    end_s = time.perf_counter()
    assert prefilled_s is not None
    return {
        "outputs": [outputs[rid] for rid in request_ids],
        "wall_s": end_s - start_s,
        "decode_s": end_s - prefilled_s,
        "num_decode_tokens": sum(num_tokens.values()) - num_tokens_at_prefilled,
        "num_steps": num_steps,
        "num_decode_steps": num_decode_steps,
        "num_decode_request_steps": num_decode_request_steps,
    }


def measure(
    base: Any, k: int, batch_size: int, prompts: list[str], warmup: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """One (k, batch size) configuration on a fresh engine over `base`'s weights."""
    from pdcluster.engine.sampling_params import SamplingParams

    longest = max(len(base.tokenizer.encode(p)) for p in prompts + warmup)
    blocks_per_request = -(-(longest + args.max_tokens + k + 2) // 16) + 1
    llm = base.replace_config(
        num_speculative_tokens=k,
        num_kv_blocks=batch_size * blocks_per_request + 8,
        block_size=16,
        max_num_seqs=batch_size,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    run_group(engine, warmup[:batch_size], params)

    contention = Contention()
    groups = [
        run_group(engine, prompts[i : i + batch_size], params) for i in range(0, len(prompts), batch_size)
    ]
    outputs = [o for g in groups for o in g["outputs"]]
    num_output_tokens = sum(len(o.token_ids) for o in outputs)
    wall_s = sum(g["wall_s"] for g in groups)
    decode_s = sum(g["decode_s"] for g in groups)
    num_decode_tokens = sum(g["num_decode_tokens"] for g in groups)
    num_decode_request_steps = sum(g["num_decode_request_steps"] for g in groups)
    drafts = [o.drafts for o in outputs]
    drafted = [sum(x) for x in zip(*(d.num_draft_tokens_per_position for d in drafts), strict=False)]
    accepted = [sum(x) for x in zip(*(d.num_accepted_tokens_per_position for d in drafts), strict=False)]
    num_draft = sum(d.num_draft_tokens for d in drafts)
    num_accepted = sum(d.num_accepted_tokens for d in drafts)
    contended = contention.stop()
    tpots = [o.tpot_s for o in outputs if o.tpot_s is not None]
    return {
        "k": k,
        "batch_size": batch_size,
        "num_requests": len(outputs),
        "num_output_tokens": num_output_tokens,
        "wall_s": round(wall_s, 4),
        "output_tokens_per_s": round(num_output_tokens / wall_s, 2),
        "decode_tokens_per_s": round(num_decode_tokens / decode_s, 2) if decode_s > 0 else None,
        "mean_ttft_ms": round(1e3 * sum(o.ttft_s for o in outputs) / len(outputs), 3),
        "mean_tpot_ms": round(1e3 * sum(tpots) / len(tpots), 3) if tpots else None,
        "num_steps": sum(g["num_steps"] for g in groups),
        "tokens_per_decode_step": ratio(num_decode_tokens, num_decode_request_steps),
        "num_draft_tokens": num_draft,
        "num_accepted_tokens": num_accepted,
        "acceptance_rate": ratio(num_accepted, num_draft),
        "num_draft_tokens_per_position": drafted,
        "num_accepted_tokens_per_position": accepted,
        "acceptance_rate_per_position": [ratio(a, d) for a, d in zip(accepted, drafted, strict=True)],
        "num_cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        **contended,
        "token_ids": [o.token_ids for o in outputs],  # dropped from the report after the k=0 comparison
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdcluster.engine.llm import LLM
    from pdcluster.models.prompts import heldout_def_prompts

    max_batch = max(args.batch_sizes)
    all_prompts = heldout_def_prompts(args.num_prompts + max_batch)
    prompts, warmup = all_prompts[: args.num_prompts], all_prompts[args.num_prompts :]
    base = LLM(args.model, num_kv_blocks=8, block_size=16)
    ks = sorted(set(args.ks))
    results = []
    speedups = {}
    for batch_size in args.batch_sizes:
        by_k = {k: measure(base, k, batch_size, prompts, warmup, args) for k in ks}
        reference = by_k[0]["token_ids"]
        for r in by_k.values():
            r["outputs_match_k0"] = r.pop("token_ids") == reference
            results.append(r)
        speedups[str(batch_size)] = {
            str(k): {
                "output_tokens_per_s": ratio(r["output_tokens_per_s"], by_k[0]["output_tokens_per_s"]),
                "decode_tokens_per_s": ratio(
                    r["decode_tokens_per_s"] or 0, by_k[0]["decode_tokens_per_s"] or 0
                ),
            }
            for k, r in by_k.items()
        }

    target_speedup = speedups.get("1", {}).get("1", {}).get("output_tokens_per_s")
    config = environment(args.model)
    config.update(
        {
            "ks": ks,
            "batch_sizes": args.batch_sizes,
            "num_prompts": len(prompts),
            "prompt_source": "pdcluster.models.prompts.heldout_def_prompts",
            "prompt_len_tokens": [len(base.tokenizer.encode(p)) for p in prompts],
            "num_warmup_prompts": len(warmup),
            "max_tokens": args.max_tokens,
            "sampling": "greedy (temperature 0), ignore_eos",
            "num_mtp_modules": len(base.engine.model.mtp_layers),
            "engine": {
                "dtype": base.engine.config.dtype,
                "kv_cache_dtype": base.engine.config.kv_cache_dtype,
                "block_size": 16,
                "max_num_seqs": "batch size",
                "enable_prefix_caching": base.engine.config.enable_prefix_caching,
                "device": base.engine.config.device,
            },
        }
    )
    return {
        "benchmark": "spec_decode",
        "config": config,
        "results": results,
        "speedup_vs_k0": speedups,
        "target": {
            "description": f"output_tokens_per_s of k=1 >= {args.target_speedup}x k=0 at batch 1",
            "speedup": target_speedup,
            "met": None if target_speedup is None else target_speedup >= args.target_speedup,
        },
    }


def table(result: dict[str, Any]) -> str:
    header = ["batch", "k", "out_tok/s", "dec_tok/s", "speedup", "accept", "per_position", "tok/step"]
    rows = []
    for r in result["results"]:
        speedup = result["speedup_vs_k0"][str(r["batch_size"])][str(r["k"])]["output_tokens_per_s"]
        rows.append(
            [
                r["batch_size"],
                r["k"],
                r["output_tokens_per_s"],
                r["decode_tokens_per_s"],
                speedup,
                r["acceptance_rate"],
                ",".join(str(a) for a in r["acceptance_rate_per_position"]) or None,
                r["tokens_per_decode_step"],
            ]
        )
    target = result["target"]
    return format_table(header, rows) + (
        f"\ntarget: {target['description']}: speedup={target['speedup']} met={target['met']}"
    )


def _problem(args: argparse.Namespace) -> str | None:
    if 0 not in args.ks:
        return "--ks must include 0 (the baseline the speedups are relative to)"
    if min(args.ks) < 0 or min(args.batch_sizes) < 1:
        return "--ks must be >= 0 and --batch-sizes >= 1"
    if args.num_prompts < 1 or args.max_tokens < 1:
        return "--num-prompts and --max-tokens must be >= 1"
    return None


def main(argv: list[str] | None = None) -> int:
    return main_with(build_parser(), argv, run, table, _problem)


if __name__ == "__main__":
    raise SystemExit(main())
