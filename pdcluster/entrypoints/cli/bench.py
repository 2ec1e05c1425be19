"""`pdcluster bench`: replay a request trace against an OpenAI-compatible endpoint (`run_bench`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdcluster.config.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
from pdcluster.entrypoints.cli.common import (
    CliError,
    add_model_options,
    non_negative_int,
    positive_int,
)


def run(args: argparse.Namespace) -> int:
    import httpx

    from pdcluster.entrypoints.bench_client import run_bench
    from pdcluster.planner.trace import load_trace

    try:
        load_trace(args.trace, num_requests=1)  # a bad trace fails before any server starts
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    server = backend = None
    endpoint = args.endpoint
    if endpoint == "local":
        from pdcluster.driver.backend import LocalEngineBackend
        from pdcluster.engine.config import EngineConfig
        from pdcluster.entrypoints.openai.app import build_app
        from pdcluster.entrypoints.openai.server import ServerThread

        backend = LocalEngineBackend(
            EngineConfig(
                model=str(args.model), device=args.device, num_speculative_tokens=args.num_speculative_tokens
            )
        )
        server = ServerThread(build_app(backend)).start()
        endpoint = server.url
    try:
        report = run_bench(
            endpoint,
            str(args.trace),
            tokenizer_dir=str(args.model),
            num_requests=args.num_requests,
            time_scale=args.time_scale,
            max_tokens_cap=args.max_tokens_cap,
            ttft_slo_ms=args.ttft_slo_ms,
            tpot_slo_ms=args.tpot_slo_ms,
            api_key=args.api_key,
            show_progress=not args.json,
        )
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise CliError(f"{endpoint}: {exc}") from exc
    finally:
        if server is not None:
            server.stop()
        if backend is not None:
            backend.shutdown()
    print(json.dumps(report.as_json(), indent=2) if args.json else report.as_table())
    return 1 if report.summary["num_failed"] else 0


NAME = "bench"
HELP = "replay a request trace against an OpenAI-compatible endpoint: TTFT/TPOT, throughput, goodput"
DESCRIPTION = """\
Replay a public trace (Azure CSV or Mooncake JSONL; a bare name is looked up in
../shared/traces) against an endpoint, streaming, at the trace's arrival times. Input lengths
are scaled to the served model's context (the output says how); prompts are held-out Python
source sent as token ids. Prints TTFT/TPOT/e2e percentiles, throughput, goodput under the SLO,
mean acceptance rate and mean KV transfer time. Exit code 1 if any request failed."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        required=True,
        metavar="URL",
        help="base URL, e.g. http://127.0.0.1:8000; 'local' serves --model in-process",
    )
    parser.add_argument(
        "--trace", required=True, type=Path, metavar="FILE", help="trace file (.csv or .jsonl)"
    )
    parser.add_argument(
        "--num-requests",
        type=positive_int,
        default=None,
        metavar="N",
        help="replay the first N requests. Default: all",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="divide arrival times by X (X > 1 replays faster). Default: 1",
    )
    parser.add_argument(
        "--max-tokens-cap",
        type=positive_int,
        default=128,
        metavar="N",
        help="cap on each request's output tokens. Default: 128",
    )
    parser.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=DEFAULT_TTFT_SLO_MS,
        metavar="MS",
        help=f"Default: {DEFAULT_TTFT_SLO_MS:g}",
    )
    parser.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=DEFAULT_TPOT_SLO_MS,
        metavar="MS",
        help=f"Default: {DEFAULT_TPOT_SLO_MS:g}",
    )
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    add_model_options(parser)
    parser.add_argument(
        "--num-speculative-tokens",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="MTP draft tokens for --endpoint local. Default: 0",
    )
