"""Batch job over a deployed topology, for `ray job submit`:

    ray job submit --working-dir . -- python -m pdcluster.entrypoints.job \\
        --cluster clusters/local.yaml --trace ../shared/traces/AzureLLMInferenceTrace_conv.csv \\
        --num-requests 50 --output results.jsonl

Replays the trace straight into the cluster (`Cluster.generate`, no HTTP), writes one JSON line per request
to `--output` and a summary to stdout; exit code 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from pdcluster.config import DEFAULT_TOPOLOGY_PATH, load_topology
from pdcluster.config.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS, time_per_output_token_s
from pdcluster.driver.cluster import Cluster
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.entrypoints.bench_client import RequestResult, format_table, summarize
from pdcluster.planner.trace import build_prompts, load_trace, scale_trace


async def _run_one(
    cluster: Cluster, index: int, prompt: list[int], max_tokens: int, arrival_s: float, start_s: float
) -> tuple[RequestResult, dict]:
    await asyncio.sleep(max(0.0, start_s + arrival_s - time.perf_counter()))
    result = RequestResult(index, len(prompt), max_tokens, arrival_s)
    record: dict = {"index": index, "num_prompt_tokens": len(prompt), "max_tokens": max_tokens}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sent_s = time.perf_counter()
    first_s = last_s = None
    token_ids: list[int] = []
    last = None
    try:
        async for delta in cluster.generate(f"job-{index}", prompt, params):
            now = time.perf_counter()
            if delta.new_token_ids:
                first_s = first_s or now
                last_s = now
                token_ids.extend(delta.new_token_ids)
            last = delta
    except Exception as exc:  # noqa: BLE001 - every failure is recorded for this request, the job goes on
        result.error = f"{type(exc).__name__}: {exc}"
        record["error"] = result.error
        return result, record
    done_s = time.perf_counter()
    result.ok = last is not None and last.finished
    result.num_output_tokens = len(token_ids)
    result.ttft_s = None if first_s is None else first_s - sent_s
    result.tpot_s = time_per_output_token_s(first_s, last_s, len(token_ids))
    result.e2e_s = done_s - sent_s
    if last is not None:
        result.phases = last.reported_phases()
        result.kv_transfer_s = last.phases.get("kv_transfer_s")
        result.acceptance_rate = last.drafts.acceptance_rate
    record.update(
        token_ids=token_ids,
        finish_reason=None if last is None else last.finish_reason,
        ttft_s=result.ttft_s,
        tpot_s=result.tpot_s,
        e2e_s=result.e2e_s,
        phases=result.phases,
        acceptance_rate=result.acceptance_rate,
    )
    return result, record


async def _replay(cluster: Cluster, workload, prompts) -> tuple[list[RequestResult], list[dict], float]:
    start_s = time.perf_counter()
    pairs = await asyncio.gather(
        *(
            _run_one(cluster, i, prompt, r.num_output_tokens, r.arrival_s, start_s)
            for i, (r, prompt) in enumerate(zip(workload.requests, prompts, strict=True))
        )
    )
    return [p[0] for p in pairs], [p[1] for p in pairs], time.perf_counter() - start_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdcluster.entrypoints.job", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--cluster", type=Path, default=DEFAULT_TOPOLOGY_PATH, help="topology YAML")
    parser.add_argument("--trace", type=Path, required=True, help="Azure .csv or Mooncake .jsonl trace")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests of the trace")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="replay arrivals this many times faster"
    )
    parser.add_argument("--max-tokens-cap", type=int, default=64, help="cap on output tokens per request")
    parser.add_argument("--output", type=Path, required=True, help="JSONL file: one result per request")
    args = parser.parse_args(argv)

    topology = load_topology(args.cluster)
    trace = load_trace(args.trace, args.num_requests)
    cluster = Cluster.deploy(topology, log=lambda msg: print(msg, flush=True))
    try:
        workload = scale_trace(trace, cluster.max_model_len, args.max_tokens_cap, args.time_scale)
        prompts = build_prompts(workload, cluster.tokenizer)
        results, records, duration_s = asyncio.run(_replay(cluster, workload, prompts))
    finally:
        cluster.shutdown()
    with args.output.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    ttft_slo_ms = topology.slo.ttft_ms or DEFAULT_TTFT_SLO_MS
    summary = summarize(results, duration_s, ttft_slo_ms, topology.slo.tpot_ms or DEFAULT_TPOT_SLO_MS)
    print(format_table(summary, workload.description))
    print(f"wrote {len(records)} results to {args.output}")
    return 1 if summary["num_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
