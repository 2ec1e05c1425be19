"""Elastic EP recovery: `python -m bench.elastic_recovery [--scenario NAME] [--json]`.

Deploys `--topology` (default `clusters/local-ep.yaml`: one prefill and one decode instance of 2 ranks, EP2,
gloo) on a local Ray, keeps `--concurrency` streams of greedy requests (`--max-tokens` each) running and,
after `--warmup-s`, hurts the decode instance as `--scenario` says, one fault after the other (the next
once the instance served again, `--between-s` later); keeps the streams going for `--after-s`, and at least
`--after-rejoin-s` once the instance has its deployed ranks again:

    kill            SIGKILL of decode rank 1 of the EP2 instance
    stall           SIGSTOP of decode rank 1 of the EP2 instance (its peer's collective times out)
    ep4-two-kills   the decode instance made EP4 (8 experts, none redundant, behind a one-rank prefill):
                    SIGKILL of rank 3, then of the leader (rank 0 of the 3 left)

Reports, for each fault (`events`; the first one's figures also at the top level), from the fault:

    time_to_reformed_s      until decode-0 is in routing again on its survivors (`/health` recoveries)
    time_to_served_again_s  until the first request sent after the fault completes
and
    time_to_rejoined_s      from the last fault until decode-0 has its deployed ranks again (null: not)
    completed / failed / hung  requests over the whole run; `failed` ended with an error; `hung` got no end
                            within `request_bound_s` (every attempt's event timeout; none may hang)
    errors                  each distinct error message (truncated), with its count
    recomputed              requests re-dispatched with their streamed tokens kept after decode lost their
                            KV (`driver.recompute`), and those tokens in all
    greedy_vs_one_engine    per phase (`before` the first fault; `during`: sent after it while decode-0 is
                            degraded; `after`: sent once it has its deployed ranks again): completed
                            requests `compared` with one single-device engine's greedy tokens (same
                            checkpoint and num_speculative_tokens) and how many `mismatched`
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import signal
import time
from typing import Any

from bench.common import format_table, main_with, new_parser
from pdcluster.engine.sampling_params import SamplingParams

PROMPTS = ["def add(a, b):\n    return", "class Stack:\n    def push(self, x):", "import os\n\ndef main():"]


SCENARIOS = {  # name -> (decode ranks, [(signal, the decode rank it goes to, numbered at that time)])
    "kill": (2, [(signal.SIGKILL, 1)]),
    "stall": (2, [(signal.SIGSTOP, 1)]),
    "ep4-two-kills": (4, [(signal.SIGKILL, 3), (signal.SIGKILL, 0)]),
}


def _topology(args):
    from pdcluster.config import load_topology

    topo = load_topology(args.topology)
    if args.kv_timeout_s is not None:
        topo = dataclasses.replace(
            topo, kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=args.kv_timeout_s)
        )
    if SCENARIOS[args.scenario][0] != 4:
        return topo
    return dataclasses.replace(  # as tests/cluster/test_cluster_elastic.py's EP4 deployment
        topo,
        hardware=dataclasses.replace(topo.hardware, devices_per_node=5),
        prefill=dataclasses.replace(
            topo.prefill, devices_per_instance=1, expert_parallel_size=1, num_redundant_experts=0
        ),
        decode=dataclasses.replace(
            topo.decode, devices_per_instance=4, expert_parallel_size=4, num_redundant_experts=0
        ),
    )


def one_engine_tokens(topology, max_tokens: int) -> dict[str, list[int]]:
    """Each of PROMPTS' greedy token ids from one single-device engine with every expert local (the
    topology's checkpoint, its decode pool's num_speculative_tokens)."""
    from pdcluster.engine.llm import LLM

    llm = LLM(topology.model.checkpoint_dir, num_speculative_tokens=topology.decode.num_speculative_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {p: llm.generate([llm.tokenizer.encode(p)], params)[0].token_ids for p in PROMPTS}


def run(args) -> dict[str, Any]:
    from pdcluster.driver.cluster import Cluster
    from pdcluster.driver.ray_runtime import init_local_ray

    topology = _topology(args)
    expected = one_engine_tokens(topology, args.max_tokens)
    init_local_ray(num_cpus=4)
    cluster = Cluster.deploy(topology, log=lambda _: None)
    try:
        return asyncio.run(_measure(cluster, args, expected))
    finally:
        cluster.shutdown()


async def _measure(cluster, args, expected: dict[str, list[int]]) -> dict[str, Any]:
    import ray

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started_s = time.monotonic()
    state_end = {"s": started_s + args.warmup_s + args.after_s}  # pushed back once decode-0 rejoined
    bound_s = cluster.event_timeout_s * (len(cluster.instances["prefill"]) + 1)  # MAX attempts, then decode
    state: dict[str, Any] = {"n": 0, "faults": []}  # faults: (time.monotonic() of the fault, its event)
    outcomes: collections.Counter[str] = collections.Counter()
    stopped: list[int] = []
    greedy = {phase: {"compared": 0, "mismatched": 0} for phase in ("before", "during", "after")}

    async def one(stream: int) -> None:
        while time.monotonic() < state_end["s"]:
            state["n"] += 1
            sent_s, prompt, tokens = time.monotonic(), PROMPTS[state["n"] % len(PROMPTS)], []
            phase = "after" if state.get("rejoined_s") else "during" if state["faults"] else "before"

            async def collect(request_id: str, prompt: str = prompt, tokens: list[int] = tokens) -> None:
                async for delta in cluster.generate(request_id, cluster.tokenizer.encode(prompt), params):
                    tokens += delta.new_token_ids

            try:
                await asyncio.wait_for(collect(f"c{stream}-{state['n']}"), bound_s)
            except TimeoutError:
                outcomes["hung"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - counted: every request completes or errs
                outcomes["failed: " + str(e).split(": ", 1)[-1][:300]] += 1  # (without the request id)
                await asyncio.sleep(0.1)
                continue
            outcomes["completed"] += 1
            greedy[phase]["compared"] += 1
            greedy[phase]["mismatched"] += tokens != expected[prompt]
            for fault_s, event in state["faults"]:
                if sent_s > fault_s and event["time_to_served_again_s"] is None:
                    event["time_to_served_again_s"] = round(time.monotonic() - fault_s, 3)

    async def faults_and_watch() -> float | None:
        await asyncio.sleep(args.warmup_s)
        num_ranks = SCENARIOS[args.scenario][0]
        for k, (sig, rank) in enumerate(SCENARIOS[args.scenario][1], 1):
            victim = cluster.instances["decode"][0].ranks[rank]
            pid = ray.get(victim.load.remote(), timeout=cluster.call_timeout_s).pid
            os.kill(pid, sig)
            fault_s = time.monotonic()
            stopped.extend([pid] if sig == signal.SIGSTOP else [])
            event: dict[str, Any] = {
                "fault": f"{sig.name} of decode rank {rank} of {num_ranks}",
                "at_s": round(fault_s - started_s, 3),
                "time_to_reformed_s": None,
                "time_to_served_again_s": None,
            }
            state["faults"].append((fault_s, event))
            while time.monotonic() < state_end["s"] and None in (
                event["time_to_reformed_s"],
                event["time_to_served_again_s"],
            ):
                health = cluster.health()["decode-0"]
                if (
                    event["time_to_reformed_s"] is None
                    and health["recoveries"] >= k
                    and health["state"] == "healthy"
                ):
                    event["time_to_reformed_s"] = round(time.monotonic() - fault_s, 3)
                await asyncio.sleep(0.05)
            num_ranks -= 1
            await asyncio.sleep(args.between_s)
        last_s = state["faults"][-1][0]
        while time.monotonic() < state_end["s"]:
            if not cluster.health()["decode-0"]["degraded"]:
                state["rejoined_s"] = time.monotonic()
                state_end["s"] = max(state_end["s"], state["rejoined_s"] + args.after_rejoin_s)
                return time.monotonic() - last_s
            await asyncio.sleep(0.05)
        return None

    try:
        rejoined, *_ = await asyncio.gather(faults_and_watch(), *(one(i) for i in range(args.concurrency)))
    finally:
        for pid in stopped:  # (killed by the driver already, or never let run again)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    errors = {k[len("failed: ") :]: v for k, v in outcomes.items() if k.startswith("failed: ")}
    events = [event for _, event in state["faults"]]
    return {
        "config": {
            "scenario": args.scenario,
            "topology": args.topology,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "warmup_s": args.warmup_s,
            "between_s": args.between_s,
            "after_s": args.after_s,
            "after_rejoin_s": args.after_rejoin_s,
            "request_bound_s": bound_s,
            "kv_timeout_s": cluster.topology.kv_transfer.timeout_s,
            "elastic_stall_s": cluster.topology.decode.elastic_stall_s,
        },
        "time_to_reformed_s": events[0]["time_to_reformed_s"] if events else None,
        "time_to_served_again_s": events[0]["time_to_served_again_s"] if events else None,
        "time_to_rejoined_s": None if rejoined is None else round(rejoined, 3),
        "events": events,
        "completed": outcomes["completed"],
        "failed": sum(errors.values()),
        "hung": outcomes["hung"],
        "errors": errors,
        "recomputed": {
            "requests": cluster.dispatcher.requests_recomputed_total,
            "tokens": cluster.dispatcher.recomputed_tokens_total,
        },
        "greedy_vs_one_engine": greedy,
        "health_after": cluster.health(),
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        (f"{e['fault']}: {k}", e[k])
        for e in result["events"]
        for k in ("time_to_reformed_s", "time_to_served_again_s")
    ]
    rows += [(k, result[k]) for k in ("time_to_rejoined_s", "completed", "failed", "hung")]
    rows += [
        (f"greedy mismatches {p}", f"{v['mismatched']} of {v['compared']}")
        for p, v in result["greedy_vs_one_engine"].items()
    ]
    return format_table(["figure", "value"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = new_parser("bench.elastic_recovery", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario", choices=sorted(SCENARIOS), default="kill", help="the faults (see above)"
    )
    parser.add_argument("--topology", default="clusters/local-ep.yaml")
    parser.add_argument("--concurrency", type=int, default=4, help="request streams kept running")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=10.0, help="seconds of serving before the kill")
    parser.add_argument(
        "--between-s", type=float, default=1.0, help="seconds from served again to the next fault"
    )
    parser.add_argument(
        "--after-s", type=float, default=60.0, help="seconds of serving after the first fault"
    )
    parser.add_argument(
        "--after-rejoin-s",
        type=float,
        default=15.0,
        help="seconds of serving at least, once the instance has its deployed ranks again",
    )
    parser.add_argument(
        "--kv-timeout-s", type=float, default=None, help="kv_transfer.timeout_s (default: the topology's)"
    )
    return main_with(parser, argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
