"""The Azure conversation replay of issue 13, disaggregated next to colocated in one run:
`python -m bench.azure_replay [--num-requests 50] [--rounds 2] [--json]`.

Method (the issue's): the first `--num-requests` requests of the Azure LLM inference conversation trace
(../shared/traces/AzureLLMInferenceTrace_conv.csv), replayed at their arrival times by the same client
(`orchestrator.bench_client.run_bench`, what `pdcluster bench` runs: streaming over HTTP, prompt lengths
scaled to the served model's context, output capped at `--max-tokens-cap`, ignore_eos, greedy) against
two servers in this process's machine:

    disaggregated   `orchestrator.serve.serve("clusters/local.yaml")`: what `pdcluster deploy
                    clusters/local.yaml` serves (1 prefill + 1 decode Ray actor, its KV transport, MTP)
    colocated       one `LLMEngine` behind `orchestrator.backend.LocalEngineBackend` and the same API
                    (what `pdcluster bench --endpoint local` serves), with the topology's decode
                    `EngineConfig` (same model, dtype, MTP k, max_model_len), one torch thread like each
                    actor (their OMP_NUM_THREADS=1; `--threads` overrides)

Both servers stay up for the whole run and the replays alternate (`--rounds` rounds of colocated then
disaggregated), so machine load drifts into both alike; each server gets one untimed warm-up replay of
`--warmup-requests` requests first. Reported per configuration and round: TTFT p50/p90 and TPOT p50
(ms, `orchestrator.bench_client.summarize`), failures, mean KV transfer (ms); the medians over the
rounds; the ratio disaggregated / colocated TTFT p50 and the difference in ms (the issue's target:
disaggregated p50 <= colocated p50 + TARGET_TTFT_P50_MARGIN_MS); and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.common import add_common_arguments, environment, format_table, positive_int, ratio, run_and_emit

TARGET_TTFT_P50_MARGIN_MS = 3.0  # issue 13: disaggregated TTFT p50 <= colocated p50 + this
DEFAULT_TRACE = "AzureLLMInferenceTrace_conv.csv"  # a bare name: looked up in ../shared/traces


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--topology", default="clusters/local.yaml", help="the disaggregated deployment")
    parser.add_argument(
        "--trace", default=DEFAULT_TRACE, help="Azure CSV or Mooncake JSONL (path or bare name)"
    )
    parser.add_argument("--num-requests", type=positive_int, default=50)
    parser.add_argument("--warmup-requests", type=positive_int, default=5)
    parser.add_argument("--rounds", type=positive_int, default=2, help="alternating replays per server")
    parser.add_argument("--max-tokens-cap", type=positive_int, default=128)
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrival times multiplied by this")
    return parser


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "ttft_p50_ms": summary["ttft_ms"].get("p50"),
        "ttft_p90_ms": summary["ttft_ms"].get("p90"),
        "tpot_p50_ms": summary["tpot_ms"].get("p50"),
        "num_failed": summary["num_failed"],
        "errors": summary["errors"],
        "mean_kv_transfer_ms": summary["mean_kv_transfer_ms"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.api.app import build_app
    from orchestrator.api.server import ServerThread
    from orchestrator.backend import LocalEngineBackend
    from orchestrator.bench_client import run_bench
    from orchestrator.serve import serve
    from orchestrator.topology import load_topology

    if args.threads is None:
        torch.set_num_threads(1)
    topo = load_topology(args.topology)
    load_before = os.getloadavg()
    rows: dict[str, list[dict[str, Any]]] = {"colocated": [], "disaggregated": []}
    engine_config = topo.engine_config("decode")
    backend = LocalEngineBackend(engine_config)
    colocated = ServerThread(build_app(backend)).start()
    try:
        with serve(topo, port=0, log=lambda _: None) as service:
            urls = {"colocated": colocated.url, "disaggregated": service.url}

            def replay(name: str, num_requests: int) -> dict[str, Any]:
                report = run_bench(
                    urls[name],
                    args.trace,
                    tokenizer_dir=str(engine_config.model),
                    num_requests=num_requests,
                    time_scale=args.time_scale,
                    max_tokens_cap=args.max_tokens_cap,
                    show_progress=False,
                )
                return report.summary

            for name in urls:
                replay(name, args.warmup_requests)
            for _ in range(args.rounds):
                for name in urls:
                    rows[name].append(_figures(replay(name, args.num_requests)))
    finally:
        colocated.stop()
        backend.shutdown()
    out: dict[str, Any] = {"rounds": rows, "median_over_rounds": {}}
    for name, per_round in rows.items():
        out["median_over_rounds"][name] = {
            key: statistics.median(r[key] for r in per_round if r[key] is not None)
            for key in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms")
            if any(r[key] is not None for r in per_round)
        }
    med = out["median_over_rounds"]
    if "ttft_p50_ms" in med["disaggregated"] and "ttft_p50_ms" in med["colocated"]:
        dis, col = med["disaggregated"]["ttft_p50_ms"], med["colocated"]["ttft_p50_ms"]
        out["ttft_p50_ratio"] = ratio(dis, col)
        out["ttft_p50_excess_ms"] = round(dis - col, 3)
        out["target_ttft_p50_within_margin"] = dis - col <= TARGET_TTFT_P50_MARGIN_MS
    out["config"] = {
        "topology": args.topology,
        "trace": args.trace,
        "num_requests": args.num_requests,
        "rounds": args.rounds,
        "max_tokens_cap": args.max_tokens_cap,
        "time_scale": args.time_scale,
        "kv_transport": topo.kv_transport,
    }
    out["load_average"] = {"before": load_before, "after": os.getloadavg()}
    out["environment"] = environment(Path(engine_config.model))
    return out


def table(result: dict[str, Any]) -> str:
    rows = [
        [name, *(round(m[k], 2) if k in m else None for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms"))]
        for name, m in result["median_over_rounds"].items()
    ]
    text = format_table(["server", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms"], rows)
    return text + f"\nexcess TTFT p50: {result.get('ttft_p50_excess_ms')} ms; load {result['load_average']}"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run_and_emit(lambda: run(args), args, table)


if __name__ == "__main__":
    main()
