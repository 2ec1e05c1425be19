"""Our engine against vLLM's CPU build on the same prompts, in one run:
`python -m bench.vs_vllm --vllm-venv ../vllm-venv [--json]`.

Method: `--num-prompts` held-out token prompts of `--prompt-len` tokens; for each batch size b the first
b prompts are generated greedily (float32, `ignore_eos`, `--max-tokens` each) as one `generate` call,
once untimed (warm-up), then `--repeats` timed calls; output tokens/s is `b * max_tokens / median wall`.
TTFT is the median wall of `--repeats` calls on the same batch with `max_tokens=1` (the batch's prefill
and first token, through the same `generate` API).
vLLM runs in a subprocess of the given venv (`bench.vllm_child`; it is never a dependency of pdcluster)
first, in its default (compiled) mode and, with `--vllm-enforce-eager`, eager too; then our
`engine.llm.LLM` in-process, for each `--compile` setting asked for. Both engines get the same
`--threads` torch threads. `match` says, per batch size, whether every prompt's greedy token ids are
identical to vLLM default's.

vLLM needs three workarounds on this model (../shared/PEERS.md): a checkpoint copy whose config.json says
`topk_method: noaux_tc` (else it has no `e_score_correction_bias`), `VLLM_MLA_DISABLE=1` (its CPU MLA
backend supports only latent head size 576; the tiny model's is 80) and `VLLM_CPU_KVCACHE_SPACE` (GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import environment, format_table, int_list, main_with, missing_vllm, new_parser, ratio

CHILD = Path(__file__).with_name("vllm_child.py")


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("bench.vs_vllm", __doc__.split("\n\n")[0])
    parser.add_argument(  # absolute (the child runs elsewhere), not resolved (a venv's python is a link)
        "--vllm-venv", type=lambda p: Path(p).absolute(), required=True, help="venv with vllm-cpu installed"
    )
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls per batch size")
    parser.add_argument(
        "--compile",
        default="off,on",
        help="our engine's `compile` settings to run, comma-separated from on/off (default: both)",
    )
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="also run vLLM eager")
    parser.add_argument("--vllm-kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-timeout-s", type=float, default=1800.0, help="limit on the vLLM subprocess")
    return parser


def vllm_checkpoint(model: Path, into: Path) -> Path:
    """A copy of `model` that vLLM loads: config.json with `topk_method: noaux_tc`, other files linked
    (links left in `into` by an earlier run are replaced)."""
    into.mkdir(parents=True, exist_ok=True)
    for file in model.iterdir():
        if file.is_file() and file.name != "config.json":
            link = into / file.name
            link.unlink(missing_ok=True)
            link.symlink_to(file.resolve())
    config = json.loads((model / "config.json").read_text())
    config["topk_method"] = "noaux_tc"
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def run_vllm(args: argparse.Namespace, model: Path, prompts: list[list[int]], eager: bool) -> dict[str, Any]:
    """One vLLM subprocess: its per-batch walls and token ids (`bench.vllm_child`).

    Raises:
        RuntimeError: the subprocess failed or printed no result (its stderr tail in the message).
    """
    python = args.vllm_venv / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python}: not a venv (see ../shared/PEERS.md for how to make one)")
    env = dict(os.environ, VLLM_MLA_DISABLE="1", VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kvcache_gib))
    job = {
        "model": str(model),
        "prompts": prompts,
        "batch_sizes": args.batch_sizes,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "enforce_eager": eager,
        "threads": args.threads,
    }
    start = time.perf_counter()
    done = subprocess.run(
        [str(python), str(CHILD)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=args.vllm_timeout_s,
        cwd=tempfile.gettempdir(),  # not the repo root: its packages must not shadow vLLM's imports
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("VS_VLLM_RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM subprocess failed (rc {done.returncode}): {done.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("VS_VLLM_RESULT "))
    result["total_s"] = round(time.perf_counter() - start, 1)
    return result


def run_ours(args: argparse.Namespace, prompts: list[list[int]], compile_: bool) -> dict[str, Any]:
    """Our `engine.llm.LLM` over the same batches, same method as `bench.vllm_child`."""
    from pdcluster.engine.llm import LLM
    from pdcluster.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, compile=compile_, max_num_seqs=max(args.batch_sizes))
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    first_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(batch: list[list[int]], sampling: SamplingParams = params) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llm.generate(batch, sampling)
        return time.perf_counter() - t0, [list(o.token_ids) for o in outs]

    run(prompts[:1])
    batches = {}
    for batch_size in args.batch_sizes:
        batch = prompts[:batch_size]
        run(batch)
        walls, token_ids = [], []
        for _ in range(args.repeats):
            wall_s, token_ids = run(batch)
            walls.append(wall_s)
        ttft_s = [run(batch, first_token)[0] for _ in range(args.repeats)]
        batches[str(batch_size)] = {"wall_s": walls, "token_ids": token_ids, "ttft_s": ttft_s}
    compiled = llm.engine.runner.compiled
    counts = {}
    if compiled is not None:
        counts = {
            "compiled_steps": compiled.num_compiled_steps,
            "eager_fallbacks": compiled.num_eager_fallbacks,
        }
    return {"load_s": round(load_s, 2), "batches": batches, **counts}


def summarize(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s per engine and batch size, ratio to vLLM default, and whether the tokens match it."""
    reference = runs["vllm_default"]["batches"]
    engines: dict[str, Any] = {}
    for name, run in runs.items():
        rows = {}
        for b, data in run["batches"].items():
            median_s = statistics.median(data["wall_s"])
            tok_s = int(b) * args.max_tokens / median_s
            ref_s = statistics.median(reference[b]["wall_s"])
            ref_tok_s = int(b) * args.max_tokens / ref_s
            num_match = sum(x == y for x, y in zip(data["token_ids"], reference[b]["token_ids"], strict=True))
            ttft_s = statistics.median(data["ttft_s"])
            rows[b] = {
                "ttft_ms": round(ttft_s * 1e3, 2),
                "ttft_vs_vllm_default": ratio(ttft_s, statistics.median(reference[b]["ttft_s"])),
                "output_tokens_per_s": round(tok_s, 1),
                "median_wall_s": round(median_s, 4),
                "wall_s": [round(w, 4) for w in data["wall_s"]],
                "vs_vllm_default": ratio(tok_s, ref_tok_s),
                "prompts_matching_vllm_default": f"{num_match}/{len(data['token_ids'])}",
                "match": num_match == len(data["token_ids"]),
            }
        engines[name] = rows
    return engines


def run(args: argparse.Namespace) -> dict[str, Any]:
    import pdcluster.engine.llm  # noqa: F401  (now: the engine measured is the code as of the start)
    from pdcluster.models.prompts import heldout_token_prompts
    from pdcluster.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(args.model)
    prompts = heldout_token_prompts(tokenizer, [args.prompt_len] * max(args.batch_sizes))
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="vs_vllm_") as tmp:
        model = vllm_checkpoint(args.model, Path(tmp) / "model")
        runs["vllm_default"] = run_vllm(args, model, prompts, eager=False)
        if args.vllm_enforce_eager:
            runs["vllm_enforce_eager"] = run_vllm(args, model, prompts, eager=True)
    for setting in args.compile.split(","):
        runs[f"pdcluster_compile_{setting}"] = run_ours(args, prompts, setting == "on")
    return {
        "benchmark": "vs_vllm",
        "config": {
            **environment(args.model),
            "batch_sizes": args.batch_sizes,
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "repeats": args.repeats,
            "dtype": "float32",
            "sampling": "greedy (temperature 0), ignore_eos",
            "vllm_version": runs["vllm_default"].get("version"),
            "vllm_env": {"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib)},
            "command": " ".join(["python -m bench.vs_vllm", *sys.argv[1:]]),
        },
        "engines": summarize(args, runs),
        "load_s": {name: r.get("load_s", r.get("total_s")) for name, r in runs.items()},
        "compiled_steps": {name: r["compiled_steps"] for name, r in runs.items() if "compiled_steps" in r},
        "eager_fallbacks": {name: r["eager_fallbacks"] for name, r in runs.items() if "eager_fallbacks" in r},
    }


def table(result: dict[str, Any]) -> str:
    rows = []
    for name, per_batch in result["engines"].items():
        for b, row in per_batch.items():
            match = row["prompts_matching_vllm_default"]
            ttft = [row["ttft_ms"], row["ttft_vs_vllm_default"]]
            rows.append([name, b, *ttft, row["output_tokens_per_s"], row["vs_vllm_default"], match])
    header = ["engine", "batch", "TTFT ms", "TTFT / vLLM", "output tok/s", "x vLLM default", "match"]
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    return main_with(build_parser(), argv, run, table, problem=lambda args: missing_vllm(args.vllm_venv))


if __name__ == "__main__":
    raise SystemExit(main())
