"""Cost of logprobs and logit processors: `python -m bench.sampling_cost [--json]`.

Issue 37's target: at batch 32, logprobs (top 5) plus presence, frequency and repetition penalties cost at
most 5% of output tokens/s against the same requests without them.

Method, per batch size B: one `LLM` (asynchronous scheduling off, MTP as `--num-speculative-tokens`), B
held-out prompts generated greedily (`ignore_eos`, `--max-tokens` each) as one `generate` call, in two
modes alternating `--num-repeats` times after one untimed call of each:

    off   temperature 0
    on    temperature 0, logprobs 5, presence_penalty 0.5, frequency_penalty 0.5, repetition_penalty 1.1

    output_tokens_per_s   B * max_tokens / wall seconds of the call (median over repeats)
    cost                  1 - on / off (of the medians)

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
    parser.add_argument("--num-repeats", type=positive_int, default=5, help="timed calls of each mode")
    parser.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens (0: off)")
    return parser


def measure(base: Any, batch_size: int, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from pdcluster.engine.sampling_params import SamplingParams

    llm = base.replace_config(
        num_speculative_tokens=args.num_speculative_tokens,
        max_num_seqs=batch_size,
        num_kv_blocks=batch_size * 16 + 8,
        async_scheduling=False,
    )
    off = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    on = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        logprobs=5,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
    )
    modes = {"off": off, "on": on}
    batch = prompts[:batch_size]
    for params in modes.values():  # warm-up
        llm.generate(batch, params)
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    contention = Contention()
    for _ in range(args.num_repeats):
        for name, params in modes.items():
            start = time.perf_counter()
            outputs = llm.generate(batch, params)
            seconds[name].append(time.perf_counter() - start)
            assert all(len(o.token_ids) == args.max_tokens for o in outputs)
    num_tokens = batch_size * args.max_tokens
    rate = {name: num_tokens / statistics.median(values) for name, values in seconds.items()}
    cost = 1 - rate["on"] / rate["off"]
    contended = contention.stop()
    fraction = contended["other_processes_cpu_fraction"]
    return {
        "batch_size": batch_size,
        "output_tokens_per_s_off": round(rate["off"], 1),
        "output_tokens_per_s_on": round(rate["on"], 1),
        "cost": round(cost, 4),
        # None: other processes took too much of the machine for a verdict (rerun on an idle machine)
        "meets_target": None if fraction is None or fraction > MAX_CONTENTION else cost <= TARGET_COST,
        "seconds": {name: [round(v, 4) for v in values] for name, values in seconds.items()},
        "contention": contended,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return sweep_batch_sizes(
        args,
        measure,
        {
            "max_tokens": args.max_tokens,
            "num_repeats": args.num_repeats,
            "num_speculative_tokens": args.num_speculative_tokens,
            "target_cost": TARGET_COST,
            "definition": "cost = 1 - median tokens/s with logprobs 5 + presence/frequency/repetition "
            "penalties / median tokens/s without them (greedy, same prompts, one engine)",
        },
    )


def table(result: dict[str, Any]) -> str:
    rows = [
        [
            r["batch_size"],
            r["output_tokens_per_s_off"],
            r["output_tokens_per_s_on"],
            f"{100 * r['cost']:.1f}%",
        ]
        for r in result["results"]
    ]
    return format_table(["batch", "tok/s off", "tok/s on", "cost"], rows)


def main(argv: list[str] | None = None) -> int:
    return main_with(build_parser(), argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
