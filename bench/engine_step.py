"""Host time per decode step spent outside the model: `python -m bench.engine_step [--json]`.

Method: the engine's `ModelRunner` is wrapped in place so that the time inside its model calls
(`forward`, `mtp_forward`, `compute_logits`) accumulates on a `time.perf_counter` clock. For each batch
size and async-scheduling mode, `batch` held-out token prompts of `--prompt-len` tokens are prefilled
(greedy, `ignore_eos`, `max_tokens` large enough that nobody finishes), `--num-warmup-steps` decode steps
run untimed, then `--num-steps` calls of `LLMEngine.step()` are timed one by one:

    wall_ms      the whole `step()` call
    model_ms     part of that call during which a model call was running, on any thread (a forward that
                 an async loop started earlier, or that still runs afterwards, counts only inside it)
    overhead_ms  wall - model: scheduling, input packing, sampling, commit/stop checks,
                 detokenization, output objects, Python and GC (everything but the model)

With async scheduling, host work that overlaps a forward on the worker thread is hidden: `overhead_ms` is
the part of the step during which no model call was running (the exposed host time, which then includes
sampling on the worker thread and waits between the two threads).

`breakdown_ms` (per step, mean) times a few named engine functions by wrapping them the same way; under
async scheduling they may run concurrently with the forward, so they need not add up to the exposed
overhead.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import time
from typing import Any

from bench.call_timer import CallTimer
from bench.common import (
    Contention,
    add_common_arguments,
    check_checkpoint,
    environment,
    format_table,
    int_list,
    run_and_emit,
    summarize_ms,
)

MODEL_CALLS = ("forward", "mtp_forward", "compute_logits")

OVERHEAD_INCLUDES = (
    "wall time of one LLMEngine.step() minus the time inside ModelRunner.forward / mtp_forward / "
    "compute_logits (lm_head + cast to float32 count as model time). It includes: Scheduler.schedule "
    "(policy, KV block allocation, slot mapping), Executor.prepare / build_input (packing the ragged "
    "batch into tensors), sampling/verification (kernels.sampling on the logits), MTP draft bookkeeping "
    "when k > 0, Scheduler.update_from_output (commit, stop checks, freeing), LLMEngine._step_outputs "
    "(incremental detokenization, stop strings, RequestOutput construction), Python interpreter and "
    "GC time, and the benchmark's own timers (two perf_counter calls per wrapped call). Host wall-clock "
    "time on time.perf_counter, not CPU time of the process."
)

# Engine functions timed for the breakdown: (attribute of LLMEngine or "" for the engine itself, candidate
# method names, first found wins, label). Input packing is `Executor.prepare` where the engine has the
# persistent-buffer executor, `Executor.build_input` before it.
BREAKDOWN_CALLS = (
    ("scheduler", ("schedule",), "schedule"),
    ("executor", ("prepare", "build_input"), "prepare_input"),
    ("executor", ("sample", "_sample_or_verify"), "sample"),
    ("scheduler", ("update_from_output",), "update_from_output"),
    ("", ("_step_outputs",), "outputs"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine_step",
        description="Host time per decode step outside the model forward (scheduling, input preparation, "
        "sampling, bookkeeping, detokenization), with async scheduling off and on. "
        "All times are milliseconds of wall-clock time (time.perf_counter) per LLMEngine.step().",
    )
    add_common_arguments(parser)
    parser.add_argument(
        "--batch-sizes",
        type=int_list,
        default="1,8,32",
        help="comma-separated numbers of concurrent requests (one decode token each per step); "
        "default: %(default)s",
    )
    parser.add_argument(
        "--async-modes",
        default="off,on",
        help="comma-separated async_scheduling modes to run: off, on (default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=64, help="tokens per prompt (held-out text); default: %(default)s"
    )
    parser.add_argument(
        "--num-warmup-steps",
        type=int,
        default=4,
        help="untimed decode steps after the prefill; default: %(default)s",
    )
    parser.add_argument(
        "--num-steps",
        type=int,
        default=128,
        help="timed decode steps per configuration; default: %(default)s",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="MTP draft tokens per step, k (MTP time counts as model time); default: %(default)s",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (0 = greedy); default: %(default)s",
    )
    parser.add_argument(
        "--target-overhead-ms",
        type=float,
        default=0.5,
        help="target (issue 11): median overhead per step at the target batch size, milliseconds; "
        "default: %(default)s",
    )
    parser.add_argument(
        "--target-batch-size",
        type=int,
        default=32,
        help="batch size the target applies to; default: %(default)s",
    )
    parser.add_argument(
        "--stream",
        choices=("on", "off"),
        default="on",
        help="on: every request's output is built and read each step (a streaming server); off: "
        "requests added with stream=False, as LLM.generate does (outputs only when they finish; "
        "tokens are counted from the scheduler's requests); default: %(default)s",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="EngineConfig compile: the decode (and short prefill) forward compiled at load, for each "
        "configuration's engine (compile time is not timed)",
    )
    parser.add_argument(
        "--no-breakdown",
        action="store_true",
        help="do not time the named engine functions "
        "(schedule, prepare_input, sample, update_from_output, outputs)",
    )
    return parser


def _parse_modes(text: str) -> list[bool]:
    modes = {"off": False, "on": True}
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or any(m not in modes for m in names):
        raise ValueError(f"--async-modes: expected a comma-separated subset of off,on; got {text!r}")
    return [modes[m] for m in names]


def measure(
    base: Any,
    prompts: list[list[int]],
    async_scheduling: bool,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Prefill `prompts` together, then time `args.num_steps` decode steps of a fresh engine."""
    from pdcluster.engine.sampling_params import SamplingParams

    batch_size = len(prompts)
    llm = base.replace_config(async_scheduling=async_scheduling, compile=args.compile)
    engine = llm.engine
    model_timer = CallTimer(record_intervals=True)
    wrapped = [name for name in MODEL_CALLS if model_timer.wrap(engine.runner, name, "model")]
    host_timer = CallTimer()
    breakdown_labels = []
    if not args.no_breakdown:
        for owner_name, methods, label in BREAKDOWN_CALLS:
            owner = getattr(engine, owner_name, None) if owner_name else engine
            if any(host_timer.wrap(owner, method, label) for method in methods):
                breakdown_labels.append(label)

    # One prefill token + warm-up + timed steps, and spare room so that no request finishes in the window.
    max_tokens = 1 + args.num_warmup_steps + (args.num_steps + 2) * (args.num_speculative_tokens + 1)
    params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    stream = args.stream == "on"
    if stream:
        request_ids = [engine.add_request(p, params) for p in prompts]
    else:
        request_ids = [engine.add_request(p, params, stream=False) for p in prompts]
    requests = [engine.scheduler.get_request(rid) for rid in request_ids]
    num_tokens = dict.fromkeys(request_ids, 0)

    def step() -> int:
        """One engine step; returns the tokens it committed."""
        before = sum(num_tokens.values())
        for out in engine.step():
            num_tokens[out.request_id] = len(out.token_ids)
        if not stream:  # no outputs before they finish: count the committed tokens
            for request in requests:
                num_tokens[request.request_id] = len(request.output_token_ids)
        return sum(num_tokens.values()) - before

    num_prefill_steps = 0
    while min(num_tokens.values()) == 0:
        step()
        num_prefill_steps += 1
        if num_prefill_steps > 10_000:
            raise RuntimeError("prefill did not finish in 10,000 steps")
    for _ in range(args.num_warmup_steps):
        step()

    gc.collect()
    contention = Contention()
    wall_s, model_s, step_tokens = [], [], []
    host_start = host_timer.snapshot()
    for _ in range(args.num_steps):
        start_s = time.perf_counter()
        step_tokens.append(step())
        end_s = time.perf_counter()
        wall_s.append(end_s - start_s)
        model_s.append(model_timer.busy_s("model", start_s, end_s))
    host_end = host_timer.snapshot()
    contended = contention.stop()

    for rid in request_ids:
        engine.abort_request(rid)
    if sum(model_s) == 0.0:
        raise RuntimeError(
            "no time was observed inside the model calls: the engine does not call the wrapped "
            f"ModelRunner methods {wrapped} (has it copied them before the benchmark wrapped them?)"
        )
    overhead_s = [w - m for w, m in zip(wall_s, model_s, strict=True)]
    return {
        "batch_size": batch_size,
        "async_scheduling": async_scheduling,
        "num_prefill_steps": num_prefill_steps,
        "num_steps": len(wall_s),
        "tokens_per_step": round(sum(step_tokens) / len(step_tokens), 3),
        "wall_ms": summarize_ms(wall_s),
        "model_ms": summarize_ms(model_s),
        "overhead_ms": summarize_ms(overhead_s),
        "overhead_fraction": round(sum(overhead_s) / sum(wall_s), 4),
        "tokens_per_s": round(sum(step_tokens) / sum(wall_s), 1),
        "breakdown_ms": {
            label: round((host_end.get(label, 0.0) - host_start.get(label, 0.0)) * 1e3 / len(wall_s), 4)
            for label in breakdown_labels
        },
        **contended,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdcluster.engine.llm import LLM
    from pdcluster.models.prompts import heldout_token_prompts

    modes = _parse_modes(args.async_modes)
    max_batch = max(args.batch_sizes)
    num_step_tokens = (args.num_steps + 3) * (args.num_speculative_tokens + 1)
    max_len = args.prompt_len + 1 + args.num_warmup_steps + num_step_tokens
    block_size = 16
    num_kv_blocks = max_batch * (-(-max_len // block_size) + 1) + 8
    base = LLM(
        args.model,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, max_batch * (args.num_speculative_tokens + 1)),
        num_speculative_tokens=args.num_speculative_tokens,
    )
    all_prompts = heldout_token_prompts(base.tokenizer, [args.prompt_len] * max_batch)
    results = []
    for async_scheduling in modes:
        for batch_size in args.batch_sizes:
            prompts = all_prompts[:batch_size]
            if not async_scheduling:
                results.append(measure(base, prompts, False, args))
                continue
            try:
                results.append(measure(base, prompts, True, args))
            except Exception as e:  # the async loop is being built: report the mode, keep going
                results.append(
                    {"batch_size": batch_size, "async_scheduling": True, "error": f"{type(e).__name__}: {e}"}
                )

    def target_met(async_scheduling: bool) -> bool | None:
        for r in results:
            if r["batch_size"] == args.target_batch_size and r["async_scheduling"] == async_scheduling:
                if "error" in r:
                    return None
                return r["overhead_ms"]["p50"] <= args.target_overhead_ms
        return None

    config = environment(args.model)
    config.update(
        {
            "batch_sizes": args.batch_sizes,
            "async_modes": ["on" if m else "off" for m in modes],
            "num_prompts": max_batch,
            "prompt_len_tokens": args.prompt_len,
            "prompt_source": "pdcluster.models.prompts.heldout_token_prompts",
            "num_warmup_steps": args.num_warmup_steps,
            "num_steps": args.num_steps,
            "num_speculative_tokens": args.num_speculative_tokens,
            "temperature": args.temperature,
            "stream": args.stream,
            "compile": args.compile,
            "engine": {
                "num_kv_blocks": num_kv_blocks,
                "block_size": block_size,
                "max_num_seqs": max_batch,
                "dtype": base.engine.config.dtype,
                "kv_cache_dtype": base.engine.config.kv_cache_dtype,
                "enable_prefix_caching": base.engine.config.enable_prefix_caching,
                "device": base.engine.config.device,
            },
            "engine_async_loop_module_found": importlib.util.find_spec("pdcluster.engine.async_loop")
            is not None,
        }
    )
    if True in modes and not config["engine_async_loop_module_found"]:
        config["async_note"] = (
            "pdcluster.engine.async_loop (named in pdcluster/engine/llm_engine.py's docstring) was not "
            "found: with "
            "async_scheduling=True the engine may have run its synchronous loop"
        )
    return {
        "benchmark": "engine_step",
        "config": config,
        "overhead_includes": OVERHEAD_INCLUDES,
        "results": results,
        "target": {
            "description": f"median overhead_ms per decode step <= {args.target_overhead_ms} ms "
            f"at batch {args.target_batch_size}",
            "met_async_off": target_met(False) if False in modes else None,
            "met_async_on": target_met(True) if True in modes else None,
        },
    }


def table(result: dict[str, Any]) -> str:
    rows = []
    for r in result["results"]:
        mode = "on" if r["async_scheduling"] else "off"
        if "error" in r:
            rows.append([r["batch_size"], mode, "error: " + r["error"][:60], "", "", "", "", ""])
            continue
        rows.append(
            [
                r["batch_size"],
                mode,
                r["wall_ms"]["mean"],
                r["model_ms"]["mean"],
                r["overhead_ms"]["mean"],
                r["overhead_ms"]["p50"],
                r["overhead_ms"]["p90"],
                r["tokens_per_s"],
            ]
        )
    header = ["batch", "async", "wall_ms", "model_ms", "overhead_ms", "ovh_p50", "ovh_p90", "tok/s"]
    target = result["target"]
    lines = [
        format_table(header, rows),
        f"target: {target['description']}: async off met={target['met_async_off']}, "
        f"async on met={target['met_async_on']}",
    ]
    for r in result["results"]:
        if r.get("breakdown_ms"):
            parts = ", ".join(f"{k} {v}" for k, v in r["breakdown_ms"].items())
            mode = "on" if r["async_scheduling"] else "off"
            lines.append(f"batch {r['batch_size']} async {mode}: {parts} (ms/step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_checkpoint(args.model)
    if problem is None:
        try:
            _parse_modes(args.async_modes)
        except ValueError as e:
            problem = str(e)
    if problem is None and (min(args.batch_sizes) < 1 or args.num_steps < 1 or args.prompt_len < 1):
        problem = "--batch-sizes, --num-steps and --prompt-len must be >= 1"
    if problem is not None:
        parser.error(problem)
    run_and_emit(lambda: run(args), args, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
