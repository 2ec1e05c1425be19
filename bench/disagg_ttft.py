"""TTFT of the disaggregated cluster next to one colocated engine: `python -m bench.disagg_ttft [--json]`.

Configurations, each fed the same prompts, one request at a time (no batching), `--warmup` requests per
prompt length discarded, then `--repeats` timed:

    colocated          one `LLMEngine` in this process behind `driver.backend.LocalEngineBackend`
                       (the single-engine server's backend: the engine steps on a background thread)
    disagg_<t>_layerwise  `Cluster.deploy`: 1 prefill + 1 decode Ray actor on a local Ray, KV over
                       transport `<t>` (`--transports`: grpc, shm), each layer's KV sent as soon as it is
                       computed
    disagg_<t>_whole   the same with `kv_transfer.layerwise=False` (`--whole`): the KV is sent once the
                       prompt is done

Why this colocated baseline is the fair one: TTFT is taken at the same interface in both cases
(`ServingBackend.generate`, the first delta that carries a token, on the caller's clock), with the same
`EngineConfig` (the prefill pool's: same chunking, token budget, MTP drafting, dtype, `compile` off; the
decode pool's `compile` is turned off too, so every engine runs eagerly as before compile became decode's
default: one request at a time its decode steps barely enter TTFT, and compiling would add tens of seconds
to each deployment) and one torch thread per engine (Cluster actors run with OMP_NUM_THREADS=1; this
process is set to `--threads`, default 1). So
the difference is exactly what disaggregation adds: the router's load snapshots and decode's reservation
(Ray calls), the prefill call, the KV handoff, decode's admission and the poll loop delivering the token.
A colocated engine inside a Ray actor would add a Ray hop the single-engine server does not have.

Prompts are random token ids (seeded, distinct per request, so no prefix-cache hit anywhere). The bundled
tiny model's context is 1,024 tokens, too short for a 1,024- or 2,048-token prompt plus an output token, so
the benchmark writes a throwaway checkpoint into a temp dir: the bundled architecture
(`models.train_tiny.tiny_config`) with `max_position_embeddings` 4,096 (YaRN factor 4,096 / 512 = 8),
random seeded weights and the bundled tokenizer (`--model` only supplies the tokenizer and vocab size).
Timing does not depend on the weights' values; the same checkpoint serves every prompt length.

`other_processes_cpu_fraction` counts the Ray actors too (they are other processes): for the disaggregated
rows it is mostly the cluster itself; for the colocated row it is the machine's background.

Reported per configuration and prompt length: TTFT median/p90 (ms), the medians of every phase the cluster
reports (`driver.messages.Phases`: route, reserve, queue, prefill compute, last layer sent, received
(`kv_transfer`: decode's `expect` to the last layer verified), admitted, first decode step), the rest of
TTFT none of them covers (`unaccounted_ms_p50`: TTFT - route - queue - prefill: the first token streams
from the prefill call's first reply (`driver.dispatch.Prefilled`), sent as it is sampled, before the
MTP pass and the last layers' send that prefill covers, so this is the prefill call's way to the prefill
rank and back less that tail; the reserve runs beside the prefill, and the KV transfer and decode's
admission come after the first token),
`after_prefill_ms`: TTFT minus queue and prefill, what the prefill compute did not hide, KV bytes per
request (model dtype, all layers incl. MTP) and the bytes the transfer reported; per prompt length the
ratios disaggregated / colocated, and whether the issue's targets hold per transport: disaggregated TTFT
(layerwise) at 2K-token prompts p50 <= `TARGET_P50_RATIO` x colocated p50 and p90 <= `TARGET_P90_RATIO` x
colocated p90.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import common
from pdcluster.driver.backend import PHASE_NAMES

TARGET_P50_RATIO = 1.05  # issue 13: disaggregated TTFT p50 <= 1.05 x colocated (layerwise, 2K prompts)
TARGET_P90_RATIO = 1.10  # and p90 <= 1.10 x colocated p90
TRANSPORTS = ("grpc", "shm")
PHASES_IN_TTFT = ("route_s", "queue_s", "prefill_s")  # consecutive on the first token's path
TARGET_PROMPT_LEN = 2048
CONTEXT_LEN = 4096  # max_position_embeddings of the throwaway checkpoint
MAX_TOKENS = 2  # TTFT needs one token; two make sure the request also went through decode
NUM_SPECIAL_TOKENS = 3  # bos, eos, pad: never in a random prompt


def build_parser() -> argparse.ArgumentParser:
    parser = common.new_parser(
        "bench.disagg_ttft",
        "TTFT of the disaggregated cluster (1 prefill + 1 decode Ray actor per KV transport; "
        "layerwise KV streaming, and whole-request with --whole) next to one colocated engine, sequential "
        "single requests, with the per-phase breakdown.",
    )
    parser.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help=f"comma-separated KV transports, from {TRANSPORTS}; default: %(default)s",
    )
    parser.add_argument("--whole", action="store_true", help="also whole-request (layerwise off) rows")
    parser.add_argument(
        "--prompt-lens",
        type=common.int_list,
        default=[512, 1024, 2048],
        help="prompt lengths in tokens; default: %(default)s",
    )
    parser.add_argument(
        "--repeats",
        type=common.positive_int,
        default=10,
        help="timed requests per point; default: %(default)s",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="discarded requests per point first; default: %(default)s"
    )
    return parser


# ---- inputs -----------------------------------------------------------------------------------------------
def write_long_context_checkpoint(model_dir: Path, out_dir: Path, seed: int = 0) -> dict[str, Any]:
    """`tiny_config` with a 4,096-token context, seeded random weights (bf16 like the bundled checkpoint),
    and `model_dir`'s tokenizer, written to `out_dir`. Returns what it wrote, for the JSON."""
    from pdcluster.models.config import DeepseekV3Config
    from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
    from pdcluster.models.loader import save_checkpoint
    from pdcluster.models.train_tiny import tiny_config

    vocab_size = DeepseekV3Config.from_json_file(model_dir / "config.json").vocab_size
    config = tiny_config(vocab_size)
    rope = config.rope_scaling
    rope = dataclasses.replace(rope, factor=CONTEXT_LEN / rope.original_max_position_embeddings)
    config = dataclasses.replace(config, max_position_embeddings=CONTEXT_LEN, rope_scaling=rope)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    save_checkpoint(model, out_dir, dtype=torch.bfloat16)
    shutil.copy(model_dir / "tokenizer.json", out_dir / "tokenizer.json")
    return {
        "checkpoint": "throwaway, written at bench time: models.train_tiny.tiny_config architecture with "
        f"max_position_embeddings {CONTEXT_LEN} (YaRN factor {rope.factor}), random weights "
        f"(torch.manual_seed({seed})), the tokenizer of {model_dir}; timing does not depend on the weights",
        "max_position_embeddings": CONTEXT_LEN,
        "yarn_factor": rope.factor,
        "weights_seed": seed,
        "num_hidden_layers": config.num_hidden_layers,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
        "kv_cache_dim": config.kv_cache_dim,
    }


def make_prompts(num_tokens: int, count: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(NUM_SPECIAL_TOKENS, vocab_size, (num_tokens,), generator=gen).tolist()
        for _ in range(count)
    ]


# ---- measurement ------------------------------------------------------------------------------------------
async def _one_request(backend, request_id: str, prompt: list[int]) -> dict[str, Any]:
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sent_s = time.perf_counter()
    first_s = None
    phases: dict[str, float] = {}
    async for delta in backend.generate(request_id, prompt, params):
        if delta.new_token_ids and first_s is None:
            first_s = time.perf_counter()
        phases = delta.reported_phases()
    assert first_s is not None, f"{request_id}: no token"
    return {"ttft_s": first_s - sent_s, "phases": phases}


def measure(backend, name: str, prompts_by_len: dict[int, list[list[int]]], warmup: int) -> dict[int, Any]:
    """Sequential requests through `backend`; per prompt length the timed requests' TTFTs and phases."""

    async def run() -> dict[int, Any]:
        results = {}
        for num_tokens, prompts in prompts_by_len.items():
            contention = common.Contention()
            samples = [
                await _one_request(backend, f"{name}-{num_tokens}-{i}", prompt)
                for i, prompt in enumerate(prompts)
            ]
            results[num_tokens] = {"samples": samples[warmup:], **contention.stop()}
        return results

    return asyncio.run(run())


def point_summary(raw: dict[str, Any], kv_bytes: int, disaggregated: bool) -> dict[str, Any]:
    samples = raw["samples"]
    ttft = [s["ttft_s"] for s in samples]
    out: dict[str, Any] = {"ttft_ms": common.summarize_ms(ttft)}
    for phase in PHASE_NAMES if disaggregated else ("queue_s", "prefill_s"):
        values = [s["phases"][phase] for s in samples if phase in s["phases"]]
        if values:
            out[f"{phase.removesuffix('_s')}_ms_p50"] = round(statistics.median(values) * 1e3, 3)
    if disaggregated:
        rest = [s["ttft_s"] - sum(s["phases"].get(p, 0.0) for p in PHASES_IN_TTFT) for s in samples]
        out["unaccounted_ms_p50"] = round(statistics.median(rest) * 1e3, 3)
        # what prefill did not hide: routing, the prefill call's way there and its reply's way back
        exposed = [s["ttft_s"] - s["phases"]["queue_s"] - s["phases"]["prefill_s"] for s in samples]
        out["after_prefill_ms_p50"] = round(statistics.median(exposed) * 1e3, 3)
        out["kv_bytes_per_request"] = kv_bytes
        wire = [s["phases"].get("kv_transfer_bytes") for s in samples]
        out["kv_transfer_bytes_reported"] = int(wire[0]) if wire and wire[0] is not None else None
    out["other_processes_cpu_fraction"] = raw["other_processes_cpu_fraction"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from pdcluster.config import load_topology
    from pdcluster.driver.backend import LocalEngineBackend
    from pdcluster.driver.cluster import Cluster
    from pdcluster.driver.ray_runtime import init_local_ray
    from pdcluster.models.config import DeepseekV3Config

    if args.threads is None:
        torch.set_num_threads(1)  # the actors' OMP_NUM_THREADS=1: one thread per engine on both sides
    num_per_point = args.warmup + args.repeats
    tmp = Path(tempfile.mkdtemp(prefix="disagg_ttft_"))
    ray_started = False
    try:
        ckpt = tmp / "tiny_4k"
        checkpoint_info = write_long_context_checkpoint(args.model, ckpt)
        env = common.environment(ckpt)  # before the temp dir goes
        arch = DeepseekV3Config.from_json_file(ckpt / "config.json")
        prompts_by_len = {
            n: make_prompts(n, num_per_point, arch.vocab_size, seed=n) for n in args.prompt_lens
        }
        base = load_topology("clusters/local.yaml")
        base = dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, path=str(ckpt)),
            decode=dataclasses.replace(base.decode, compile=False),  # eager, like colocated (docstring)
        )
        engine_config = base.engine_config("prefill")
        num_kv_layers = arch.num_hidden_layers + (1 if engine_config.num_speculative_tokens else 0)
        itemsize = getattr(torch, engine_config.dtype).itemsize

        def kv_bytes(n: int) -> int:
            return n * num_kv_layers * arch.kv_cache_dim * itemsize

        raw: dict[str, dict[int, Any]] = {}
        backend = LocalEngineBackend(engine_config, name="colocated")
        try:
            raw["colocated"] = measure(backend, "colo", prompts_by_len, args.warmup)
        finally:
            backend.shutdown()

        init_local_ray(num_cpus=4)
        ray_started = True
        deploy_s = {}
        for name, transport, layerwise in configurations(args):
            topo = dataclasses.replace(
                base,
                kv_transfer=dataclasses.replace(base.kv_transfer, transport=transport, layerwise=layerwise),
            )
            started_s = time.perf_counter()
            cluster = Cluster.deploy(topo, log=lambda msg: print(msg, file=sys.stderr, flush=True))
            deploy_s[name] = round(time.perf_counter() - started_s, 2)
            try:
                raw[name] = measure(cluster, name, prompts_by_len, args.warmup)
            finally:
                cluster.shutdown()
    finally:
        if ray_started:
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    points = []
    for n in args.prompt_lens:
        point: dict[str, Any] = {"prompt_tokens": n}
        for name in raw:
            point[name] = point_summary(raw[name][n], kv_bytes(n), name != "colocated")
        colo = point["colocated"]["ttft_ms"]
        for name in [c for c in raw if c != "colocated"]:
            ttft = point[name]["ttft_ms"]
            point[f"ratio_{name}_over_colocated"] = {
                "p50": common.ratio(ttft["p50"], colo["p50"]),
                "p90": common.ratio(ttft["p90"], colo["p90"]),
            }
            point[f"overhead_{name}_ms_p50"] = round(ttft["p50"] - colo["p50"], 3)
        points.append(point)
    target_point = next((p for p in points if p["prompt_tokens"] == TARGET_PROMPT_LEN), None)
    target: dict[str, Any] = {
        "rule": f"disagg_<transport>_layerwise TTFT p50 <= {TARGET_P50_RATIO} x colocated p50 and p90 <= "
        f"{TARGET_P90_RATIO} x colocated p90 at {TARGET_PROMPT_LEN}-token prompts",
    }
    for name, _, layerwise in configurations(args):
        if layerwise and target_point is not None:
            r = target_point[f"ratio_{name}_over_colocated"]
            met = None not in (r["p50"], r["p90"])
            met = met and r["p50"] <= TARGET_P50_RATIO and r["p90"] <= TARGET_P90_RATIO
            target[name] = {"ratio_p50": r["p50"], "ratio_p90": r["p90"], "met": met}
    return {
        "config": {
            **env,
            **checkpoint_info,
            "colocated": "LocalEngineBackend (one LLMEngine in this process, stepping on a thread)",
            "disaggregated": "Cluster.deploy on a local Ray: 1 prefill + 1 decode actor per transport",
            "engine_dtype": engine_config.dtype,
            "max_num_batched_tokens": engine_config.max_num_batched_tokens,
            "num_speculative_tokens": engine_config.num_speculative_tokens,
            "max_tokens": MAX_TOKENS,
            "prompts": "random token ids, seeded, distinct per request (no prefix-cache hits)",
            "repeats": args.repeats,
            "warmup": args.warmup,
            "deploy_s": deploy_s,
        },
        "points": points,
        "target": target,
    }


def configurations(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(row name, transport, layerwise) of each disaggregated configuration."""
    transports = [t for t in args.transports.split(",") if t]
    rows = [(f"disagg_{t}_layerwise", t, True) for t in transports]
    return rows + ([(f"disagg_{t}_whole", t, False) for t in transports] if args.whole else [])


def table(result: dict[str, Any]) -> str:
    rows = []
    for p in result["points"]:
        for name in [k for k in p if k == "colocated" or k.startswith("disagg_")]:
            s = p[name]
            rows.append(
                (
                    p["prompt_tokens"],
                    name,
                    s["ttft_ms"]["p50"],
                    s["ttft_ms"]["p90"],
                    None if name == "colocated" else p[f"ratio_{name}_over_colocated"]["p50"],
                    None if name == "colocated" else p[f"ratio_{name}_over_colocated"]["p90"],
                    *(s.get(f"{n}_ms_p50") for n in ("route", "reserve", "queue", "prefill")),
                    *(s.get(f"{n}_ms_p50") for n in ("last_layer_sent", "kv_transfer", "admit")),
                    s.get("unaccounted_ms_p50"),
                )
            )
    header = ("prompt", "config", "ttft p50", "p90", "ratio p50", "p90", "route", "reserve", "queue",
              "prefill", "last layer sent", "received", "admitted", "rest")  # fmt: skip
    note = (
        "(ms; phases are medians; the first token streams from the prefill call's first reply, as it is "
        "sampled: rest = TTFT - route - queue - prefill, the call's way there and back less prefill's tail "
        "after the token; reserve, received and admitted run beside or after it)"
    )
    lines = [common.format_table(header, rows), note, f"target: {result['target']['rule']}"]
    lines += [f"  {k}: {v}" for k, v in result["target"].items() if k != "rule"]
    return "\n".join(lines)


def _problem(args: argparse.Namespace) -> str | None:
    if any(t not in TRANSPORTS for t in args.transports.split(",") if t):
        return f"--transports must be from {TRANSPORTS}"
    if args.warmup < 0 or any(n < 1 or n + MAX_TOKENS > CONTEXT_LEN for n in args.prompt_lens):
        return f"prompt lengths must be in [1, {CONTEXT_LEN - MAX_TOKENS}]"
    return None


def main(argv: list[str] | None = None) -> int:
    return common.main_with(build_parser(), argv, run, table, _problem)


if __name__ == "__main__":
    sys.exit(main())
