"""Speculation overhead of one k=1 decode step: `python -m bench.spec_overhead [--json]`.

Issue 11's target: a k=1 step costs at most 5% more than the model's own work, the k=0 main forward over
the same 2 query tokens per request plus the MTP layer's forward (+ its lm_head) on the same shapes.

Method, per batch size B (greedy, `ignore_eos`, asynchronous scheduling off): an engine with k=1 prefills B
held-out prompts and decodes until every request runs a 2-token query (its bonus token + 1 draft); the
`Executor.run` call of the next step is captured (its `SchedulerOutput` and packed inputs). Replaying it is
idempotent for greedy requests (the same KV values go to the same slots; no randomness is drawn), so the
three timed parts run on exactly that step, alternating, `--num-repeats` times each:

    step_ms      (a) `Executor.run`: main forward, verify (logits of 2 rows per request, accept rule),
                 MTP draft of d_1 and its bookkeeping: the whole device-side step
    main_ms      (b) `ModelRunner.forward` over the step's batch (2 query tokens per request) plus
                 `compute_logits` of its 2B rows: a k=0 forward over the same tokens
    mtp_ms       (c) `ModelRunner.mtp_forward` over the same 2B positions plus `compute_logits` of B rows
                 (one draft per request): the MTP layer's own work
    overhead     median(a) / (median(b) + median(c)) - 1

(b) and (c) rewrite KV slots of the step (the MTP ones with other values); (a) rewrites them again, so each
(a) sees the cache of the captured step. Times are `time.perf_counter` wall clock, medians in ms.
`--compile` runs the engine with the compiled decode forward (compiled at load; (b) then runs it too).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.batch_sweep import sweep_batch_sizes
from bench.common import (
    add_common_arguments,
    check_checkpoint,
    format_table,
    int_list,
    positive_int,
    run_and_emit,
    summarize_ms,
)

TARGET_OVERHEAD = 0.05


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.spec_overhead", description=__doc__.splitlines()[0]
    )
    add_common_arguments(parser)
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    parser.add_argument("--num-repeats", type=positive_int, default=30, help="timed calls of each part")
    parser.add_argument(
        "--num-decode-steps", type=positive_int, default=6, help="decode steps before capture"
    )
    parser.add_argument("--compile", action="store_true", help="compiled decode forward (engine.compile)")
    return parser


def capture_step(engine: Any, num_decode_steps: int) -> tuple[Any, Any]:
    """Step `engine` `num_decode_steps` times, then until every request verifies one draft; returns that
    step's `(SchedulerOutput, PreparedStep)` as `Executor.run` received them."""
    executor = engine.executor
    captured: list[tuple[Any, Any]] = []
    original = executor.run

    def run(output, prepared, *args, **kwargs):
        captured.append((output, prepared))
        return original(output, prepared, *args, **kwargs)

    executor.run = run
    try:
        for step in range(num_decode_steps + 20):
            captured.clear()
            engine.step()
            if step < num_decode_steps or not captured:
                continue
            output, prepared = captured[-1]
            if output.scheduled and all(s.num_scheduled_tokens == 2 and len(s.spec_token_ids) == 1
                                        for s in output.scheduled):  # fmt: skip
                return output, prepared
    finally:
        del executor.run
    raise RuntimeError("no decode step in which every request verified one draft")


def measure(base: Any, batch_size: int, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdcluster.engine.sampling_params import SamplingParams

    llm = base.replace_config(
        num_speculative_tokens=1,
        num_kv_blocks=batch_size * 16 + 8,
        block_size=16,
        max_num_seqs=batch_size,
        async_scheduling=False,
        compile=args.compile,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for prompt in prompts[:batch_size]:
        engine.add_request(prompt, params)
    output, prepared = capture_step(engine, args.num_decode_steps)
    executor, runner = engine.executor, engine.runner
    batch = prepared.batch
    last_rows = batch.query_start_loc[1:] - 1

    def step() -> None:
        executor.run(output, prepared)

    def main() -> torch.Tensor:
        hidden = runner.forward(batch, num_queries=2)
        runner.compute_logits(hidden)
        return hidden

    hidden = main()

    def mtp() -> None:
        out = runner.mtp_forward(batch, hidden)
        runner.compute_logits(out[last_rows])

    parts = {"step": step, "main": main, "mtp": mtp}
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(3):  # warm-up
        for fn in parts.values():
            fn()
    for _ in range(args.num_repeats):
        for name in ("step", "main", "mtp", "step"):  # step first and last: both halves see fresh caches
            start = time.perf_counter()
            parts[name]()
            times[name].append(time.perf_counter() - start)
        step()  # leaves the cache as the captured step wrote it
    medians = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    overhead = medians["step"] / (medians["main"] + medians["mtp"]) - 1
    return {
        "batch_size": batch_size,
        "step_ms": summarize_ms(times["step"]),
        "main_ms": summarize_ms(times["main"]),
        "mtp_ms": summarize_ms(times["mtp"]),
        "overhead": round(overhead, 4),
        "meets_target": overhead <= TARGET_OVERHEAD,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    definition = (
        "overhead = median(k=1 Executor.run) / (median(k=0 forward + logits over the "
        "same 2 query tokens) + median(MTP forward + draft logits)) - 1"
    )
    config = {"compile": args.compile, "num_repeats": args.num_repeats, "target_overhead": TARGET_OVERHEAD}
    return sweep_batch_sizes(args, measure, {**config, "definition": definition})


def table(result: dict[str, Any]) -> str:
    rows = [
        [
            r["batch_size"],
            r["step_ms"]["p50"],
            r["main_ms"]["p50"],
            r["mtp_ms"]["p50"],
            f"{100 * r['overhead']:.1f}%",
        ]
        for r in result["results"]
    ]
    return format_table(["batch", "k=1 step ms", "k=0 fwd ms", "MTP ms", "overhead"], rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_checkpoint(args.model)
    if problem:
        build_parser().error(problem)
    run_and_emit(lambda: run(args), args, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
