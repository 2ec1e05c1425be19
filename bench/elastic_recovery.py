"""Elastic EP recovery: `python -m bench.elastic_recovery [--json]`.

Deploys `clusters/local-ep.yaml` (one prefill and one decode instance of 2 ranks, EP2, gloo) on a local Ray,
keeps `--concurrency` streams of greedy requests (`--max-tokens` each) running, SIGKILLs decode rank 1 after
`--warmup-s`, and keeps the streams going for `--after-s`. Reports, from the kill:

    time_to_reformed_s      until decode-0 is in routing again on its survivor (`/health` recoveries 1)
    time_to_served_again_s  until the first request sent after the kill completes
    time_to_rejoined_s      until decode-0 has its deployed number of ranks again (null: it did not)
    completed / failed      requests over the whole run; `failed` ended with an error (none may hang)
    errors                  each distinct error message (truncated), with its count
    recomputed              requests re-dispatched with their streamed tokens kept after decode lost their
                            KV (`driver.recompute`), and those tokens in all
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import signal
import time
from typing import Any

from bench.common import format_table, main_with, new_parser
from pdcluster.engine.sampling_params import SamplingParams

PROMPTS = ["def add(a, b):\n    return", "class Stack:\n    def push(self, x):", "import os\n\ndef main():"]


def run(args) -> dict[str, Any]:
    from pdcluster.config import load_topology
    from pdcluster.driver.cluster import Cluster
    from pdcluster.driver.ray_runtime import init_local_ray

    init_local_ray(num_cpus=4)
    topo = load_topology(args.topology)
    topo = dataclasses.replace(
        topo, kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=args.kv_timeout_s)
    )
    cluster = Cluster.deploy(topo, log=lambda _: None)
    try:
        return asyncio.run(_measure(cluster, args))
    finally:
        cluster.shutdown()


async def _measure(cluster, args) -> dict[str, Any]:
    import ray

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started_s = time.monotonic()
    end_s = started_s + args.warmup_s + args.after_s
    state: dict[str, Any] = {"killed_s": None, "served_again_s": None, "n": 0}
    outcomes: collections.Counter[str] = collections.Counter()

    async def one(stream: int) -> None:
        while time.monotonic() < end_s:
            state["n"] += 1
            sent_s, prompt = time.monotonic(), PROMPTS[state["n"] % len(PROMPTS)]
            try:
                async for _ in cluster.generate(
                    f"c{stream}-{state['n']}", cluster.tokenizer.encode(prompt), params
                ):
                    pass
            except Exception as e:  # noqa: BLE001 - counted: every request completes or errs
                outcomes["failed: " + str(e).split(": ", 1)[-1][:100]] += 1  # (without the request id)
                await asyncio.sleep(0.1)
                continue
            outcomes["completed"] += 1
            killed_s = state["killed_s"]
            if killed_s is not None and sent_s > killed_s and state["served_again_s"] is None:
                state["served_again_s"] = time.monotonic() - killed_s

    async def kill_and_watch() -> dict[str, float | None]:
        await asyncio.sleep(args.warmup_s)
        victim = cluster.instances["decode"][0].ranks[1]
        pid = ray.get(victim.load.remote(), timeout=cluster.call_timeout_s).pid
        os.kill(pid, signal.SIGKILL)
        killed_s = state["killed_s"] = time.monotonic()
        reformed = rejoined = None
        while time.monotonic() < end_s:
            health = cluster.health()["decode-0"]
            if reformed is None and health["recoveries"] >= 1 and health["state"] == "healthy":
                reformed = time.monotonic() - killed_s
            if reformed is not None and rejoined is None and not health["degraded"]:
                rejoined = time.monotonic() - killed_s
            await asyncio.sleep(0.05)
        return {"time_to_reformed_s": reformed, "time_to_rejoined_s": rejoined}

    watched, *_ = await asyncio.gather(kill_and_watch(), *(one(i) for i in range(args.concurrency)))
    errors = {k[len("failed: ") :]: v for k, v in outcomes.items() if k.startswith("failed: ")}
    return {
        "config": {
            "topology": args.topology,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "warmup_s": args.warmup_s,
            "after_s": args.after_s,
            "kv_timeout_s": args.kv_timeout_s,
        },
        **{k: None if v is None else round(v, 3) for k, v in watched.items()},
        "time_to_served_again_s": None
        if state["served_again_s"] is None
        else round(state["served_again_s"], 3),
        "completed": outcomes["completed"],
        "failed": sum(errors.values()),
        "errors": errors,
        "recomputed": {
            "requests": cluster.dispatcher.requests_recomputed_total,
            "tokens": cluster.dispatcher.recomputed_tokens_total,
        },
        "health_after": cluster.health(),
    }


def table(result: dict[str, Any]) -> str:
    keys = ("time_to_reformed_s", "time_to_served_again_s", "time_to_rejoined_s", "completed", "failed")
    return format_table(["figure", "value"], [(k, result[k]) for k in keys])


def main(argv: list[str] | None = None) -> int:
    parser = new_parser("bench.elastic_recovery", __doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="clusters/local-ep.yaml")
    parser.add_argument("--concurrency", type=int, default=4, help="request streams kept running")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=10.0, help="seconds of serving before the kill")
    parser.add_argument("--after-s", type=float, default=60.0, help="seconds of serving after the kill")
    parser.add_argument("--kv-timeout-s", type=float, default=10.0, help="kv_transfer.timeout_s")
    return main_with(parser, argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
