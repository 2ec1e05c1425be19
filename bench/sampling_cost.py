"""Cost of logprobs and logit processors: `python -m bench.sampling_cost [--json]`.

Issue 37's target: at batch 32, logprobs (top 5) plus presence, frequency and repetition penalties cost at
most 5% of output tokens/s against the same requests without them.

Method, per batch size B: one `LLM` (asynchronous scheduling off, MTP as `--num-speculative-tokens`), B
held-out prompts generated (`ignore_eos`, `--max-tokens` each) as one `generate` call per mode:

    off      temperature 0
    on       temperature 0, logprobs 5, presence_penalty 0.5, frequency_penalty 0.5, repetition_penalty 1.1
    (`--seeded`) unseeded / seeded: temperature 0.8, without / with a `seed` per request

One untimed call of each mode, then (unless `--no-gc-freeze`) `engine.gc_heap.freeze_gc_heap`, as a rank
actor does after loading; then `--num-repeats` pairs, each mode once per pair, the order alternating:

    output_tokens_per_s   B * max_tokens / wall seconds of the call (median over repeats)
    cost                  median over pairs of 1 - off seconds / on seconds (same for seeded / unseeded)

Times are `time.perf_counter` wall clock on a shared machine: compare the two modes of one run only;
`meets_target` is None when other processes took more than `MAX_CONTENTION` of the machine's CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.batch_sweep import sweep_batch_sizes
from bench.common import Contention, add_common_arguments, format_table, int_list, main_with, positive_int

TARGET_COST = 0.05
MAX_CONTENTION = 0.25  # other processes' share of the machine's CPU above which no verdict is given


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sampling_cost", description=__doc__.splitlines()[0]
    )
    add_common_arguments(parser)
    parser.add_argument("--batch-sizes", type=int_list, default=[32])
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens per request")
    parser.add_argument("--num-repeats", type=positive_int, default=5, help="timed pairs of calls")
    parser.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens (0: off)")
    parser.add_argument("--seeded", action="store_true", help="also time seeded against unseeded sampling")
    parser.add_argument("--no-gc-freeze", action="store_true", help="leave the GC heap unfrozen")
    return parser


def _pairs(
    llm: Any, batch: list[str], first: Any, second: Any, num_repeats: int, max_tokens: int
) -> tuple[list[float], list[float]]:
    """Seconds of `num_repeats` calls of each params list, alternating which runs first in a pair."""
    seconds: tuple[list[float], list[float]] = ([], [])
    for repeat in range(num_repeats):
        order = (0, 1) if repeat % 2 == 0 else (1, 0)
        for which in order:
            start = time.perf_counter()
            outputs = llm.generate(batch, (first, second)[which])
            seconds[which].append(time.perf_counter() - start)
            assert all(len(o.token_ids) == max_tokens for o in outputs)
    return seconds


def _summary(name: str, base: list[float], other: list[float], num_tokens: int) -> dict[str, Any]:
    costs = sorted(1 - b / o for b, o in zip(base, other, strict=True))
    quartiles = statistics.quantiles(costs, n=4) if len(costs) > 1 else [costs[0]] * 3
    return {
        f"{name}cost": round(statistics.median(costs), 4),
        f"{name}cost_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
        f"{name}tokens_per_s": [round(num_tokens / statistics.median(v), 1) for v in (base, other)],
    }


def measure(base: Any, batch_size: int, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from pdcluster.engine.gc_heap import freeze_gc_heap
    from pdcluster.engine.sampling_params import SamplingParams

    llm = base.replace_config(
        num_speculative_tokens=args.num_speculative_tokens,
        max_num_seqs=batch_size,
        num_kv_blocks=batch_size * 16 + 8,
        async_scheduling=False,
    )
    common = {"max_tokens": args.max_tokens, "ignore_eos": True}
    off = SamplingParams(temperature=0.0, **common)
    on = SamplingParams(
        temperature=0.0,
        logprobs=5,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        **common,
    )
    batch = prompts[:batch_size]
    unseeded = [SamplingParams(temperature=0.8, **common)] * batch_size
    seeded = [SamplingParams(temperature=0.8, seed=i, **common) for i in range(batch_size)]
    for params in (off, on, *((unseeded, seeded) if args.seeded else ())):  # warm-up
        llm.generate(batch, params)
    if not args.no_gc_freeze:
        freeze_gc_heap()
    contention = Contention()
    seconds = dict(
        zip(("off", "on"), _pairs(llm, batch, off, on, args.num_repeats, args.max_tokens), strict=True)
    )
    num_tokens = batch_size * args.max_tokens
    result: dict[str, Any] = {"batch_size": batch_size}
    summary = _summary("", seconds["off"], seconds["on"], num_tokens)
    result["output_tokens_per_s_off"], result["output_tokens_per_s_on"] = summary.pop("tokens_per_s")
    result.update(summary)
    if args.seeded:
        pairs = _pairs(llm, batch, unseeded, seeded, args.num_repeats, args.max_tokens)
        seconds.update(zip(("unseeded", "seeded"), pairs, strict=True))
        result.update(_summary("seeded_", *pairs, num_tokens))
    contended = contention.stop()
    fraction = contended["other_processes_cpu_fraction"]
    cost = result["cost"]
    # None: other processes took too much of the machine for a verdict (rerun on an idle machine)
    result["meets_target"] = None if fraction is None or fraction > MAX_CONTENTION else cost <= TARGET_COST
    result["gc_frozen"] = not args.no_gc_freeze
    result["seconds"] = {name: [round(v, 4) for v in values] for name, values in seconds.items()}
    result["contention"] = contended
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    return sweep_batch_sizes(
        args,
        measure,
        {
            "max_tokens": args.max_tokens,
            "num_repeats": args.num_repeats,
            "num_speculative_tokens": args.num_speculative_tokens,
            "target_cost": TARGET_COST,
            "definition": "cost = median over alternating pairs of 1 - seconds without / seconds with "
            "logprobs 5 + presence/frequency/repetition penalties (greedy, same prompts, one engine)",
        },
    )


def table(result: dict[str, Any]) -> str:
    rows = [
        [
            r["batch_size"],
            r["output_tokens_per_s_off"],
            r["output_tokens_per_s_on"],
            f"{100 * r['cost']:.1f}%",
            f"{100 * r['seeded_cost']:.1f}%" if "seeded_cost" in r else "-",
        ]
        for r in result["results"]
    ]
    return format_table(["batch", "tok/s off", "tok/s on", "cost", "seeded cost"], rows)


def main(argv: list[str] | None = None) -> int:
    return main_with(build_parser(), argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
