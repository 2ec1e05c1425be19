"""Elastic expert parallelism on a real local Ray cluster (one deployment, phases in order): one prefill and
one decode instance of 2 ranks each (EP2, 2 redundant experts, MTP k=1, gloo), as `clusters/local-ep.yaml`.

What it proves: SIGKILL of one decode rank, under a steady stream, while a handoff to it is in flight and
requests stream on the other: none hangs, the requests it lost are re-dispatched with their streamed tokens
kept (their phases saying how many were recomputed), those streaming on the survivor go on there without a
recompute, all with one engine's tokens; decode-0 is re-formed
on its survivor (a world of 1 holding all 8 experts) and serves again, greedy outputs equal to one
engine's, /health saying so. SIGSTOP of one prefill rank: its peer's collective times out and prefill-0
shrinks too, the idle re-formed decode group stepping meanwhile. Grow back: the first replacement decode
rank is killed while it joins (the survivors keep serving), the next one joins; a request running on the
survivor across the switch goes on untouched; both instances serve on 2 ranks again, EPLB rebalanced once
on the load observed, with outputs equal to one engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

import pytest

from pdcluster.config import Topology, load_topology
from pdcluster.driver.cluster import PROBE_INTERVAL_S
from pdcluster.driver.handoff import decode_has_it
from pdcluster.driver.router import RankRef
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts
from pdcluster.workers.rank import EP_STATS_REFRESH_S
from tests.cluster.conftest import assert_nothing_held, call_bound_s, deployed_with_loop, request_bound_s
from tests.faults import FAULT_WORKERS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
STREAM = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_def_prompts(4, min_chars=40, max_chars=200)


@pytest.fixture(scope="module")
def oracle(prompts):
    """One single-device engine (all experts local, MTP k=1): the greedy tokens the cluster must give."""
    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1)
    short = [llm.generate([llm.tokenizer.encode(p)], GREEDY)[0].token_ids for p in prompts]
    stream = [llm.generate([llm.tokenizer.encode(p)], STREAM)[0] for p in prompts]
    return short, llm.generate([llm.tokenizer.encode(prompts[0])], LONG)[0].token_ids, stream


@pytest.fixture
def cluster(ray_session):
    """Torn down after its test: the EP4 test's deployment needs the CPUs Ray reserved for it."""
    topo = load_topology("clusters/local-ep.yaml")
    topo = dataclasses.replace(
        topo,
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
        decode=dataclasses.replace(topo.decode, kv_cache_memory_bytes=16 << 20, compile=False),
        # 10 s: the collective timeout (a stalled rank is given up on after it) and the handoff lease
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=10),
    )
    with deployed_with_loop(topo, worker_classes=FAULT_WORKERS) as cluster:
        yield cluster


def run(cluster, coro):
    return cluster.test_loop.run_until_complete(coro)


async def generate(cluster, request_id: str, prompt: str, params: SamplingParams) -> list[int]:
    return (await streamed(cluster, request_id, prompt, params))[0]


async def streamed(
    cluster, request_id: str, prompt: str, params: SamplingParams
) -> tuple[list[int], str, dict]:
    """The token ids and text the client received, and the last delta's phases."""
    tokens, text, phases = [], "", {}
    async for delta in cluster.generate(request_id, cluster.tokenizer.encode(prompt), params):
        tokens, text, phases = tokens + delta.new_token_ids, text + delta.new_text, delta.phases
    return tokens, text, phases


def five_device_topology(**decode: object) -> Topology:
    """`clusters/local-ep.yaml` on 5 devices: one single-device prefill instance; the decode pool changed by
    `decode` (eager); 16 MiB of KV cache per rank; KV timeout 10 s."""
    topo = load_topology("clusters/local-ep.yaml")
    return dataclasses.replace(
        topo,
        hardware=dataclasses.replace(topo.hardware, devices_per_node=5),
        prefill=dataclasses.replace(
            topo.prefill,
            devices_per_instance=1,
            expert_parallel_size=1,
            num_redundant_experts=0,
            kv_cache_memory_bytes=16 << 20,
        ),
        decode=dataclasses.replace(topo.decode, compile=False, kv_cache_memory_bytes=16 << 20, **decode),
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=10),
    )


def shrink_bound_s(cluster) -> float:
    """Noticing a lost rank (a probe round, bounded by call_timeout_s, after the survivor's collective
    failed: at once for a dead peer, after collective_timeout_s for a stalled one) plus re-forming (the
    survivors' rendezvous, bounded by twice the collective timeout plus a call)."""
    return (
        PROBE_INTERVAL_S
        + cluster.collective_timeout_s
        + 2 * call_bound_s(cluster)
        + 2 * cluster.collective_timeout_s
        + cluster.call_timeout_s
    )


def ready_bound_s(cluster) -> float:
    """A replacement rank's start: an actor's ready timeout (`driver.rank_actors.ready_timeout_s`)."""
    from pdcluster.driver.rank_actors import ready_timeout_s

    return ready_timeout_s(cluster.topology) + PROBE_INTERVAL_S


def wait_shrunk(cluster, name: str, recoveries: int) -> dict:
    deadline_s = time.monotonic() + shrink_bound_s(cluster)
    while True:
        health = cluster.health()[name]
        if health["state"] == "healthy" and health["recoveries"] == recoveries:
            return health
        assert time.monotonic() < deadline_s, cluster.health()
        time.sleep(0.1)


def pid_of(ray, actor, cluster) -> int:
    return ray.get(actor.load.remote(), timeout=cluster.call_timeout_s).pid


def ranks_at(cluster) -> dict[str, tuple[int, bool]]:
    """Each request in flight: its decode rank and whether decode holds its KV (`decode_has_it`)."""
    records = cluster.dispatcher._requests.items()
    return {rid: (r.attempt.decode.rank, decode_has_it(r.attempt.state)) for rid, r in records if r.attempt}


def assert_only_the_lost_rank_recomputed(phases: dict[str, dict], at_kill: dict, lost: set[int]) -> None:
    """Requests whose KV a lost rank held were recomputed (their streamed tokens counted again); those whose
    KV a survivor held went on there without a recompute. At least one of each."""
    on_lost = [rid for rid, (rank, _) in at_kill.items() if rank in lost and rid in phases]
    on_survivors = [rid for rid, (rank, has) in at_kill.items() if rank not in lost and has and rid in phases]
    assert on_lost and on_survivors, at_kill
    assert all("recomputed_tokens" in phases[rid] for rid in on_lost), (at_kill, phases)
    assert not [rid for rid in on_survivors if "recomputed_tokens" in phases[rid]], (at_kill, phases)


def test_a_lost_rank_shrinks_its_instance_which_serves_again(cluster, ray_session, prompts, oracle) -> None:
    oracle, oracle_long, oracle_stream = oracle
    elastic = cluster.monitor.elastic
    elastic.grow_after_s = float("inf")  # no replacement ranks until the last phase
    for i, prompt in enumerate(prompts[:2]):  # both decode ranks, before
        assert (
            run(cluster, asyncio.wait_for(generate(cluster, f"before{i}", prompt, GREEDY), 120)) == oracle[i]
        )

    # ---- SIGKILL of decode rank 1 under a steady stream, while a handoff to it is in flight -------------
    rank1 = cluster.instances["decode"][0].ranks[1]
    pid1 = pid_of(ray_session, rank1, cluster)
    # every handoff rank 1 receives waits before its admission: one is surely in flight when it is killed
    ray_session.get(rank1.inject_delay.remote("before_admit", shrink_bound_s(cluster), 100), timeout=60)

    def in_handoff_to_rank1() -> bool:
        attempts = [r.attempt for r in cluster.dispatcher._requests.values() if r.attempt is not None]
        return any(a.decode == RankRef(0, 1) and not decode_has_it(a.state) for a in attempts)

    def mid_stream() -> bool:
        return any(len(r.streamed_token_ids) >= 2 for r in cluster.dispatcher._requests.values())

    async def stream_and_kill():
        tasks, at_kill = [], None
        for i in range(12):
            tasks.append(asyncio.ensure_future(streamed(cluster, f"s{i}", prompts[i % 4], STREAM)))
            await asyncio.sleep(0.3)
            if i >= 3 and at_kill is None and in_handoff_to_rank1() and mid_stream():
                at_kill = ranks_at(cluster)
                os.kill(pid1, signal.SIGKILL)
        bound_s = request_bound_s(cluster) + shrink_bound_s(cluster)
        return at_kill, await asyncio.gather(
            *(asyncio.wait_for(t, bound_s) for t in tasks), return_exceptions=True
        )

    at_kill, results = run(cluster, stream_and_kill())
    assert at_kill is not None
    assert not [r for r in results if isinstance(r, asyncio.TimeoutError)], results  # none hangs
    # the requests rank 1 lost (in their handoff to it) were re-dispatched with the tokens already streamed
    # kept; those streaming on rank 0 went on there untouched: one stream each, no token twice, exactly one
    # engine's tokens and text
    assert not [r for r in results if isinstance(r, BaseException)], results
    for i, (tokens, text, _) in enumerate(results):
        assert (tokens, text) == (oracle_stream[i % 4].token_ids, oracle_stream[i % 4].text), i
    assert_only_the_lost_rank_recomputed({f"s{i}": r[2] for i, r in enumerate(results)}, at_kill, {1})
    recomputed = [phases["recomputed_tokens"] for _, _, phases in results if "recomputed_tokens" in phases]
    assert all(0 <= n < STREAM.max_tokens for n in recomputed), recomputed
    stats = cluster.stats()
    assert stats["requests_recomputed_total"] == len(recomputed)
    assert stats["recomputed_tokens_total"] == sum(recomputed)
    health = wait_shrunk(cluster, "decode-0", 1)
    assert (health["ranks"], health["deployed_ranks"], health["degraded"]) == (1, 2, True)
    ep = cluster.stats()["ranks"]["decode-0"]["ep"]
    assert (ep["num_ranks"], ep["rank"]) == (1, 0)
    for i, prompt in enumerate(prompts):  # served again, by the survivor alone (EP1, all 8 experts)
        assert (
            run(cluster, asyncio.wait_for(generate(cluster, f"after{i}", prompt, GREEDY), 120)) == oracle[i]
        )

    # ---- SIGSTOP of prefill rank 1: its peer's collective times out, prefill-0 shrinks --------------------
    stopped = cluster.instances["prefill"][0].ranks[1]
    pid = pid_of(ray_session, stopped, cluster)
    os.kill(pid, signal.SIGSTOP)
    try:
        health = wait_shrunk(cluster, "prefill-0", 1)
    finally:
        os.kill(pid, signal.SIGCONT)  # (killed by the driver already; harmless then)
    assert (health["ranks"], health["degraded"]) == (1, True)
    for i, prompt in enumerate(prompts):  # the shrunk decode group idled meanwhile: no deadlock
        assert run(cluster, asyncio.wait_for(generate(cluster, f"late{i}", prompt, GREEDY), 120)) == oracle[i]
    assert set(cluster.check_no_leaks()) == {"prefill-0", "decode-0"}
    assert_nothing_held(cluster)

    # ---- grow back: the first replacement decode rank is killed while it joins; the next one joins -------
    elastic.grow_after_s = 0.0
    deadline_s = time.monotonic() + ready_bound_s(cluster)
    while ("decode", 0) not in elastic.growing:
        assert time.monotonic() < deadline_s
        time.sleep(0.01)
    first = elastic.growing[("decode", 0)]
    ray_session.kill(first.newcomers[0])

    def grown(name: str) -> bool:
        health = cluster.health()[name]
        return health["ranks"] == 2 and health["state"] == "healthy"

    async def long_requests_across_the_switch():
        """Long requests one after the other on the shrunk instances until both grew: the one running when
        decode-0 switched groups goes on untouched on its rank (the same tokens as one engine's)."""
        outputs, spanned, deadline_s = [], 0, time.monotonic() + 2 * ready_bound_s(cluster)
        while not (grown("decode-0") and grown("prefill-0")):
            assert time.monotonic() < deadline_s, cluster.health()
            before = grown("decode-0")
            outputs.append(await generate(cluster, f"long{len(outputs)}", prompts[0], LONG))
            spanned += grown("decode-0") and not before
        return outputs, spanned

    outputs, spanned = run(cluster, long_requests_across_the_switch())
    assert outputs == [oracle_long] * len(outputs) and spanned == 1
    for name in ("decode-0", "prefill-0"):
        assert cluster.health()[name]["degraded"] is False and cluster.health()[name]["rejoins"] == 1
    assert cluster.instances["decode"][0].ranks[1] is not first.newcomers[0]

    async def concurrently():
        return await asyncio.gather(
            *(generate(cluster, f"grown{i}", p, GREEDY) for i, p in enumerate(prompts * 2)),
            return_exceptions=True,
        )

    assert run(cluster, asyncio.wait_for(concurrently(), 2 * request_bound_s(cluster))) == oracle * 2
    names = ("decode-0", "decode-0.1", "prefill-0", "prefill-0.1")
    deadline_s = time.monotonic() + 2 * call_bound_s(cluster)  # rank figures are copied between steps
    while True:
        ranks = cluster.stats()["ranks"]
        if all(ranks[n]["ep"]["num_rebalances"] for n in names) or time.monotonic() > deadline_s:
            break
        time.sleep(0.1)
    for name in names:
        assert (ranks[name]["ep"]["num_ranks"], ranks[name]["ep"]["rank"]) == (2, int(name.endswith(".1")))
        assert ranks[name]["ep"]["num_rebalances"] == 1, name  # EPLB on the observed load once grown
    assert_nothing_held(cluster)


async def kill_mid_stream(cluster, pid: int, ids: list[str], prompts: list[str], sig=signal.SIGKILL):
    """Stream `ids` at once; once decode holds every one's KV and each streamed 2 tokens, send `sig` to
    `pid`. Returns `ranks_at` the kill and each request's `streamed` (or its exception)."""
    tasks = [
        asyncio.ensure_future(streamed(cluster, rid, prompts[i % 4], STREAM)) for i, rid in enumerate(ids)
    ]
    deadline_s = time.monotonic() + request_bound_s(cluster)
    records = cluster.dispatcher._requests
    while not all(
        rid in records
        and ranks_at(cluster).get(rid, (0, False))[1]
        and len(records[rid].streamed_token_ids) >= 2
        for rid in ids
    ):
        assert time.monotonic() < deadline_s, ranks_at(cluster)
        await asyncio.sleep(0.05)
    at_kill = ranks_at(cluster)
    os.kill(pid, sig)
    bound_s = request_bound_s(cluster) + shrink_bound_s(cluster)
    return at_kill, await asyncio.gather(
        *(asyncio.wait_for(t, bound_s) for t in tasks), return_exceptions=True
    )


def test_an_ep4_decode_instance_loses_two_ranks_one_after_the_other(ray_session, prompts, oracle) -> None:
    """EP4 decode (8 experts, none redundant: 2 per rank) behind a one-rank prefill: SIGKILL of rank 3,
    then SIGSTOP of the leader (rank 0 of the 3 left: its peers' collectives time out), each while 8
    requests stream on all ranks: the victim's are recomputed, the survivors' go on untouched (renumbered
    the second time), all with one engine's tokens. Each time it shrinks (to 3 ranks of 3 expert slots,
    then 2 of 4; the lost leader's successor hosts the new group) and serves outputs equal to one engine's
    one request at a time, the ranks without one joining its steps idle (no deadlock); then the two
    survivors grow back to 4 ranks and serve one engine's outputs."""
    oracle, oracle_stream = oracle[0], oracle[2]
    topo = five_device_topology(devices_per_instance=4, expert_parallel_size=4, num_redundant_experts=0)
    with deployed_with_loop(topo) as cluster:
        cluster.monitor.elastic.grow_after_s = float("inf")
        for step, (victim, ranks_left, sig) in enumerate(((3, 3, signal.SIGKILL), (0, 2, signal.SIGSTOP))):
            pid = pid_of(ray_session, cluster.instances["decode"][0].ranks[victim], cluster)
            ids = [f"ep4-stream-{step}-{i}" for i in range(8)]
            try:
                at_kill, results = run(cluster, kill_mid_stream(cluster, pid, ids, prompts, sig))
            finally:
                if sig == signal.SIGSTOP:
                    with contextlib.suppress(ProcessLookupError):  # (killed by the driver already)
                        os.kill(pid, signal.SIGCONT)
            assert not [r for r in results if isinstance(r, BaseException)], results
            for i, (tokens, text, _) in enumerate(results):
                assert (tokens, text) == (oracle_stream[i % 4].token_ids, oracle_stream[i % 4].text), i
            phases = {rid: r[2] for rid, r in zip(ids, results, strict=True)}
            assert_only_the_lost_rank_recomputed(phases, at_kill, {victim})
            assert all(
                phases[rid]["recomputed_tokens"] >= 2 for rid, (r, _) in at_kill.items() if r == victim
            )
            health = wait_shrunk(cluster, "decode-0", step + 1)
            assert (health["ranks"], health["deployed_ranks"]) == (ranks_left, 4)
            ep = [r["ep"] for name, r in cluster.stats()["ranks"].items() if name.startswith("decode")]
            assert sorted((e["rank"], e["num_ranks"]) for e in ep) == [
                (r, ranks_left) for r in range(ranks_left)
            ]
            assert all(len(e["expert_load"][0]) == 8 for e in ep)
            for i, prompt in enumerate(prompts):
                got = run(
                    cluster, asyncio.wait_for(generate(cluster, f"ep4-{step}-{i}", prompt, GREEDY), 120)
                )
                assert got == oracle[i], (step, i)
            deadline_s = time.monotonic() + 2 * EP_STATS_REFRESH_S + call_bound_s(cluster)
            while True:  # the ranks without the request stepped idle (their figures refresh every second)
                ep = [r["ep"] for name, r in cluster.stats()["ranks"].items() if name.startswith("decode")]
                if sum(e["num_idle_steps"] for e in ep) > 0:
                    break
                assert time.monotonic() < deadline_s, ep
                time.sleep(0.1)
            assert cluster.monitor.elastic.growing == {}
        # grow back: both survivors switch to the EP4 group after the same step (`engine.grow_vote`)
        cluster.monitor.elastic.grow_after_s = 0.0
        deadline_s = time.monotonic() + 2 * ready_bound_s(cluster)
        while (h := cluster.health()["decode-0"])["ranks"] != 4 or h["state"] != "healthy":
            assert time.monotonic() < deadline_s, h
            time.sleep(0.1)
        for i, prompt in enumerate(prompts):
            got = run(cluster, asyncio.wait_for(generate(cluster, f"ep4-grown-{i}", prompt, GREEDY), 120))
            assert got == oracle[i], i
        assert_nothing_held(cluster)
