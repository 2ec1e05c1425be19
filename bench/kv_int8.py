"""INT8 latent KV cache vs float: bytes per token, greedy agreement, tokens/s. `python -m bench.kv_int8`.

For each model dtype in `--dtypes`, the checkpoint is loaded in that dtype and two engines run over the same
weights: `kv_cache_dtype="auto"` (cache in the model dtype) and `"int8"` (int8 values + one float32 scale
per token per layer). Reported per engine:

    kv_cache_bytes_per_token  `ModelRunner.kv_cache_bytes_per_token`: all cached layers (main + MTP)
    tokens_per_s              output tokens / wall time, greedy, `--batch-size` requests at a time,
                              prefill included (no prefix caching), after one untimed warm-up group on
                              other prompts; the median of `--num-repeats` passes
    free_running_agreement    int8 vs the float cache of the same model dtype, free-running: per
                              prompt, the tokens before the first divergence count as matching; summed
                              over prompts and divided by all reference tokens (one near-tie flip ends
                              a prompt's count, so this is the strict figure)
    teacher_forced_agreement  the float engine's continuation run through the int8 runner in one pass;
                              positions whose greedy choice equals the float token, over all tokens (as
                              tests/engine/test_llm.py::test_int8_kv_cache_agrees_with_float measures)

bfloat16-vs-float32 agreement (both with float caches) is reported too, as a yardstick for how much any
lower-precision change moves greedy tokens on this model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from fractions import Fraction
from typing import Any

from bench.common import Contention, environment, format_table, main_with, new_parser, ratio
from pdcluster.models.dtypes import DTYPES as DTYPE_TABLE
from pdcluster.models.dtypes import MODEL_DTYPE_NAMES

DTYPES = MODEL_DTYPE_NAMES


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "bench.kv_int8",
        "INT8 latent KV cache vs float: KV bytes per token (all layers), greedy-token agreement "
        "(matching tokens before the first divergence / all tokens) and output tokens/s (tokens per "
        "second of wall-clock time).",
    )
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help=f"comma-separated model dtypes to load the checkpoint in, from {', '.join(DTYPES)}; "
        "default: %(default)s",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=32,
        help="held-out prompts (models.prompts.heldout_def_prompts, mixed lengths); default: %(default)s",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="greedy output tokens per prompt (ignore_eos); default: %(default)s",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="requests generated together (the prompts run in groups of this size); default: %(default)s",
    )
    parser.add_argument(
        "--num-repeats",
        type=int,
        default=3,
        help="timed passes over the prompts per engine; tokens/s is their median; default: %(default)s",
    )
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="stop each request at the model's EOS token, as tests/engine/test_llm.py does (default: "
        "ignore_eos, so every configuration generates exactly --max-tokens per prompt; tokens after "
        "an EOS are less certain and diverge sooner)",
    )
    parser.add_argument(
        "--min-agreement",
        type=float,
        default=0.99,
        help="teacher-forced agreement the tests require of int8 vs float (a fraction), reported as met "
        "or not; "
        "default: %(default)s",
    )
    return parser


def prefix_agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, int]:
    """(tokens before the first divergence, summed over prompts; all reference tokens)."""
    same = total = 0
    for out, expected in zip(outputs, reference, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(out, expected, strict=False)) if a != b), None)
        same += min(len(out), len(expected)) if n is None else n
        total += len(expected)
    return same, total


def teacher_forced_agreement(
    llm: Any, prompts: list[str], reference: list[list[int]], block_size: int
) -> tuple[int, int]:
    """(positions where `llm`'s runner picks the reference token, all reference tokens).

    Each prompt + its reference continuation runs through the runner in one pass (every key read back
    from its paged cache), as in tests/engine/test_llm.py::test_int8_kv_cache_agrees_with_float. Call it
    with no request in flight: it writes the cache from block 0.
    """
    from pdcluster.engine.model_runner import build_model_input

    runner = llm.engine.runner
    same = total = 0
    for prompt, expected in zip(prompts, reference, strict=True):
        seq = llm.tokenizer.encode(prompt) + expected
        num_prompt_tokens = len(seq) - len(expected)
        num_blocks = -(-len(seq) // block_size)
        batch = build_model_input([seq[:-1]], [0], [list(range(num_blocks))], block_size, runner.device)
        predicted = runner.compute_logits(runner.forward(batch)).argmax(-1).tolist()
        same += sum(predicted[i] == seq[i + 1] for i in range(num_prompt_tokens - 1, len(seq) - 1))
        total += len(expected)
    return same, total


def exact_ratio(num: int, den: int) -> dict[str, Any]:
    """`{"bytes": "580/1152", "reduced": "145/288", "ratio": 0.5035}`."""
    return {"bytes": f"{num}/{den}", "reduced": str(Fraction(num, den)), "ratio": round(num / den, 4)}


def measure(
    llm: Any, prompts: list[str], warmup: list[str], params: Any, batch_size: int, num_repeats: int
) -> dict[str, Any]:
    """Greedy tokens and tokens/s of one engine (median over `num_repeats` passes over the prompts)."""
    llm.generate(warmup, params)
    contention = Contention()
    token_ids: list[list[int]] = []
    runs_tokens_per_s = []
    for _ in range(num_repeats):
        pass_token_ids: list[list[int]] = []
        wall_s = 0.0
        for i in range(0, len(prompts), batch_size):
            start_s = time.perf_counter()
            outputs = llm.generate(prompts[i : i + batch_size], params)
            wall_s += time.perf_counter() - start_s
            pass_token_ids.extend(o.token_ids for o in outputs)
        if token_ids and pass_token_ids != token_ids:
            raise RuntimeError("greedy outputs changed between repeats of the same engine")
        token_ids = pass_token_ids
        runs_tokens_per_s.append(round(sum(len(t) for t in token_ids) / wall_s, 2))
    contended = contention.stop()
    runner = llm.engine.runner
    num_layers = len(runner.kv_caches)
    return {
        "model_dtype": llm.engine.config.dtype,
        "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
        "kv_cache_element_dtype": str(runner.kv_caches[0].dtype).removeprefix("torch."),
        "kv_cache_bytes_per_token": runner.kv_cache_bytes_per_token,
        "kv_cache_bytes_per_token_per_layer": runner.kv_cache_bytes_per_token // num_layers,
        "num_cached_layers": num_layers,
        "num_output_tokens": sum(len(t) for t in token_ids),
        "tokens_per_s": statistics.median(runs_tokens_per_s),
        "tokens_per_s_runs": runs_tokens_per_s,
        **contended,
        "token_ids": token_ids,  # dropped from the report after the agreement counts
    }


def run(args: argparse.Namespace, dtypes: list[str]) -> dict[str, Any]:
    from pdcluster.engine.llm import LLM
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.kernels.kv_quant import kv_cache_bytes_per_token
    from pdcluster.models.prompts import heldout_def_prompts

    batch_size = min(args.batch_size, args.num_prompts)
    all_prompts = heldout_def_prompts(args.num_prompts + batch_size)
    prompts, warmup = all_prompts[: args.num_prompts], all_prompts[args.num_prompts :]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)

    results = []
    by_key: dict[tuple[str, str], dict[str, Any]] = {}
    prompt_lens: list[int] = []
    kv_dim = 0
    block_size = 16
    teacher_forced: dict[str, tuple[int, int]] = {}
    for dtype in dtypes:
        probe = LLM(args.model, dtype=dtype, num_kv_blocks=1, block_size=block_size)
        prompt_lens = [len(probe.tokenizer.encode(p)) for p in prompts]
        kv_dim = probe.engine.model.config.kv_cache_dim
        longest = max(prompt_lens + [len(probe.tokenizer.encode(p)) for p in warmup])
        num_kv_blocks = batch_size * (-(-(longest + args.max_tokens + 1) // block_size) + 1) + 8
        for kv_cache_dtype in ("auto", "int8"):
            llm = probe.replace_config(
                kv_cache_dtype=kv_cache_dtype,
                num_kv_blocks=num_kv_blocks,
                max_num_seqs=batch_size,
                enable_prefix_caching=False,  # repeats recompute their prompts, like the first pass
            )
            r = measure(llm, prompts, warmup, params, batch_size, args.num_repeats)
            by_key[(dtype, kv_cache_dtype)] = r
            results.append(r)
        # Teacher-forced: the float engine's continuation through the int8 runner (`llm` is the int8 one).
        tf_same, tf_total = teacher_forced_agreement(
            llm, prompts, by_key[(dtype, "auto")]["token_ids"], block_size
        )
        teacher_forced[dtype] = (tf_same, tf_total)
        del probe, llm

    agreement = {}
    for dtype in dtypes:
        same, total = prefix_agreement(
            by_key[(dtype, "int8")]["token_ids"], by_key[(dtype, "auto")]["token_ids"]
        )
        tf_same, tf_total = teacher_forced[dtype]
        agreement[f"int8_vs_{dtype}"] = {
            "model_dtype": dtype,
            "num_tokens": total,
            "free_running_num_matching_tokens": same,
            "free_running_agreement": round(same / total, 4),
            "teacher_forced_num_matching_tokens": tf_same,
            "teacher_forced_agreement": round(tf_same / tf_total, 4),
            "teacher_forced_met_min_agreement": tf_same / tf_total >= args.min_agreement,
        }
    if "float32" in dtypes and "bfloat16" in dtypes:
        same, total = prefix_agreement(
            by_key[("bfloat16", "auto")]["token_ids"], by_key[("float32", "auto")]["token_ids"]
        )
        agreement["bfloat16_vs_float32"] = {
            "kv_cache_dtype": "auto",
            "num_tokens": total,
            "free_running_num_matching_tokens": same,
            "free_running_agreement": round(same / total, 4),
        }
    for r in results:
        r.pop("token_ids")

    # Bytes per token of each cache dtype, from the runners (int8 taken from the first model dtype's run).
    bytes_per_token = {dtype: by_key[(dtype, "auto")]["kv_cache_bytes_per_token"] for dtype in dtypes}
    bytes_per_token["int8"] = by_key[(dtypes[0], "int8")]["kv_cache_bytes_per_token"]
    ratios = {
        f"int8_vs_{dtype}": exact_ratio(bytes_per_token["int8"], bytes_per_token[dtype]) for dtype in dtypes
    }
    num_layers = by_key[(dtypes[0], "int8")]["num_cached_layers"]
    config = environment(args.model)
    config.update(
        {
            "dtypes": dtypes,
            "num_prompts": len(prompts),
            "prompt_source": "pdcluster.models.prompts.heldout_def_prompts",
            "prompt_len_tokens": prompt_lens,
            "num_warmup_prompts": len(warmup),
            "max_tokens": args.max_tokens,
            "batch_size": batch_size,
            "sampling": "greedy (temperature 0), " + ("stop at EOS" if args.stop_at_eos else "ignore_eos"),
            "num_repeats": args.num_repeats,
            "engine": {"block_size": block_size, "enable_prefix_caching": False, "device": "cpu"},
        }
    )
    return {
        "benchmark": "kv_int8",
        "config": config,
        "kv_cache_bytes_per_token": {
            "num_cached_layers": num_layers,
            "kv_dim": kv_dim,
            "by_cache_dtype": bytes_per_token,
            "ratios": ratios,
            "layout": "float caches: kv_dim x dtype.itemsize bytes per layer; int8: kv_dim x 1 byte + one "
            "float32 scale (4 bytes) per layer; kv_dim = kv_lora_rank + qk_rope_head_dim",
            "deepseek_v3_per_layer_bytes": {
                name: kv_cache_bytes_per_token(576, DTYPE_TABLE[name], 1)
                for name in ("float32", "bfloat16", "int8")
            },
        },
        "agreement": agreement,
        "results": results,
        "speedup_int8_vs_float": {
            dtype: ratio(by_key[(dtype, "int8")]["tokens_per_s"], by_key[(dtype, "auto")]["tokens_per_s"])
            for dtype in dtypes
        },
    }


def table(result: dict[str, Any]) -> str:
    header = ["model", "kv_cache", "bytes/token", "tok/s"]
    rows = [
        [r["model_dtype"], r["kv_cache_element_dtype"], r["kv_cache_bytes_per_token"], r["tokens_per_s"]]
        for r in result["results"]
    ]
    lines = [format_table(header, rows)]
    kv = result["kv_cache_bytes_per_token"]
    for name, rt in kv["ratios"].items():
        lines.append(f"bytes {name}: {rt['bytes']} = {rt['ratio']} ({kv['num_cached_layers']} layers)")
    for name, a in result["agreement"].items():
        line = (
            f"agreement {name}: free-running {a['free_running_num_matching_tokens']}/{a['num_tokens']}"
            f" = {a['free_running_agreement']}"
        )
        if "teacher_forced_agreement" in a:
            line += (
                f"; teacher-forced {a['teacher_forced_num_matching_tokens']}/{a['num_tokens']}"
                f" = {a['teacher_forced_agreement']}"
            )
        lines.append(line)
    return "\n".join(lines)


def _dtypes(args: argparse.Namespace) -> list[str]:
    return [d.strip() for d in args.dtypes.split(",") if d.strip()]


def _problem(args: argparse.Namespace) -> str | None:
    dtypes = _dtypes(args)
    if not dtypes or any(d not in DTYPES for d in dtypes):
        return f"--dtypes: expected a comma-separated subset of {', '.join(DTYPES)}, got {args.dtypes!r}"
    if min(args.num_prompts, args.max_tokens, args.batch_size, args.num_repeats) < 1:
        return "--num-prompts, --max-tokens, --batch-size and --num-repeats must be >= 1"
    return None


def main(argv: list[str] | None = None) -> int:
    return main_with(build_parser(), argv, lambda args: run(args, _dtypes(args)), table, _problem)


if __name__ == "__main__":
    raise SystemExit(main())
