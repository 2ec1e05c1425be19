"""Instances of several ranks on a real local Ray cluster (one deployment per module, torn down at its end):
one prefill instance of 2 ranks and two decode instances of 2 ranks each, routed experts split over the
ranks of each instance (EP2, 2 redundant experts), MTP k=1.

What it proves: every rank of every instance serves (the router picks (instance, rank); the reservation,
the KV handoff and the token stream go to that rank) with greedy outputs and MTP acceptance equal to one
single-device engine's, also for a 200-token request on one rank while the other rank of its instance has
nothing to run (lockstep without deadlock); the per-rank loads reach `stats()`; and killing one rank of a
decode instance mid-generation fails every request of that instance (both ranks) with a clear error
within the cluster's own timeouts, takes it out of routing, while the other instance keeps serving; and
stalling one rank (SIGSTOP) fails its instance the same way, for good once the peer's collective timed out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from pdcluster.config import load_topology
from pdcluster.driver.backend import BackendUnavailable
from pdcluster.driver.router import RankRef
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts
from tests.cluster.conftest import assert_nothing_held, call_bound_s, deployed_with_loop, request_bound_s

pytestmark = pytest.mark.slow

NUM_PROMPTS = 8  # two rounds over the 4 decode ranks (round robin)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def ep_topology(num_decode_ranks: int = 2, num_decode_instances: int = 2, redundant: int = 2):
    """`clusters/local-ep.yaml` with `num_decode_instances` decode instances of `num_decode_ranks` ranks
    (EP over all of them, `redundant` redundant experts), round-robin routing (so consecutive requests go
    to every rank in turn), small KV caches and a 10 s transfer timeout (the waits below derive from it)."""
    topo = load_topology("clusters/local-ep.yaml")
    num_devices = topo.prefill.num_devices + num_decode_instances * num_decode_ranks
    return dataclasses.replace(
        topo,
        hardware=dataclasses.replace(topo.hardware, devices_per_node=num_devices),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
        decode=dataclasses.replace(
            topo.decode,
            num_instances=num_decode_instances,
            devices_per_instance=num_decode_ranks,
            expert_parallel_size=num_decode_ranks,
            num_redundant_experts=redundant,
            kv_cache_memory_bytes=16 << 20,
            compile=False,  # EP runs eagerly anyway (CompiledDecodeForward.supported); said outright
            elastic_ep=False,  # the fixed-group behaviour (a lost rank fails its instance for good)
        ),
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=10),
        router=dataclasses.replace(topo.router, policy="round_robin"),
    )


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_def_prompts(NUM_PROMPTS, min_chars=40, max_chars=300)


@pytest.fixture(scope="module")
def oracle(prompts):
    """One single-device engine (all experts local, MTP k=1), one request at a time: the greedy outputs
    the cluster must reproduce token for token, with the same drafted/accepted counts."""
    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    return {
        "short": [llm.generate([i], GREEDY)[0] for i in ids],
        "long": llm.generate([ids[0]], LONG)[0],
    }


@pytest.fixture(scope="module")
def cluster(ray_session):
    with deployed_with_loop(ep_topology()) as cluster:
        yield cluster


def run(cluster, coro):
    return cluster.test_loop.run_until_complete(coro)


async def generate(cluster, request_id: str, prompt: str, params: SamplingParams, routes=None):
    """(tokens, last delta); `routes[request_id]` gets the decode (instance, rank) the request went to."""
    tokens, last = [], None
    async for delta in cluster.generate(request_id, cluster.tokenizer.encode(prompt), params):
        if routes is not None and request_id not in routes:
            routes[request_id] = cluster.dispatcher._requests[request_id].attempt.decode
        tokens += delta.new_token_ids
        last = delta
    return tokens, last


def test_every_rank_serves_outputs_equal_to_one_engine(cluster, prompts, oracle) -> None:
    routes: dict[str, RankRef] = {}
    for i, (prompt, expected) in enumerate(zip(prompts, oracle["short"], strict=True)):
        tokens, last = run(cluster, asyncio.wait_for(generate(cluster, f"r{i}", prompt, GREEDY, routes), 120))
        assert tokens == expected.token_ids, (i, routes[f"r{i}"])
        assert last.ranks["decode"] == cluster.instances["decode"][routes[f"r{i}"].instance].rank_name(
            routes[f"r{i}"].rank
        )
        assert last.finish_reason == "length"
        assert (last.drafts.num_draft_tokens, last.drafts.num_accepted_tokens) == (
            expected.drafts.num_draft_tokens,
            expected.drafts.num_accepted_tokens,
        )
    # round robin over the 4 decode ranks: each served 2 of the 8 requests
    assert sorted(routes.values()) == sorted([RankRef(i, r) for i in (0, 1) for r in (0, 1)] * 2)
    assert_nothing_held(cluster)


def test_a_long_request_on_one_rank_while_its_peer_idles(cluster, prompts, oracle) -> None:
    """200 tokens on one rank; the other rank of its instance has no request the whole time (in lockstep
    it steps with an empty batch): no deadlock, the same tokens and acceptance as one engine."""
    tokens, last = run(cluster, asyncio.wait_for(generate(cluster, "long", prompts[0], LONG), 300))
    expected = oracle["long"]
    assert tokens == expected.token_ids
    assert (last.drafts.num_draft_tokens, last.drafts.num_accepted_tokens) == (
        expected.drafts.num_draft_tokens,
        expected.drafts.num_accepted_tokens,
    )
    assert_nothing_held(cluster)


def test_stats_report_every_rank(cluster) -> None:
    stats = cluster.stats()
    names = {"decode-0", "decode-0.1", "decode-1", "decode-1.1"}
    assert set(stats["kv_blocks"]) == names
    assert set(stats["ranks"]) == names | {"prefill-0", "prefill-0.1"}
    for name in names:
        rank = stats["ranks"][name]
        assert rank["num_running"] == 0 and rank["num_free_blocks"] == rank["num_total_blocks"] > 0
    # every rank runs its engine expert-parallel: rank r of 2, 5 of the 10 physical experts per MoE layer
    for name, rank in stats["ranks"].items():
        ep = rank["ep"]
        assert (ep["rank"], ep["num_ranks"]) == (1 if name.endswith(".1") else 0, 2), name
        assert len(ep["moe_layers"]) == len(ep["imbalance"]) == len(ep["expert_load"]) > 0
        assert all(len(load) == 8 for load in ep["expert_load"])  # per logical expert
    # the tests above ran one request at a time: each stepped rank had a peer with nothing to run
    for instance in ("decode-0", "decode-1"):
        peers = [stats["ranks"][instance]["ep"], stats["ranks"][f"{instance}.1"]["ep"]]
        # (each rank's figures are copied by its engine thread at most every second: no exact equality)
        assert peers[0]["num_steps"] > 0 and peers[1]["num_steps"] > 0
        assert peers[0]["num_idle_steps"] > 0 and peers[1]["num_idle_steps"] > 0


def test_killing_one_rank_fails_its_instance_as_one_unit(cluster, ray_session, prompts) -> None:
    """One long request on each of the 4 decode ranks; ray.kill of rank 1 of decode-1: decode-1 leaves
    routing, both its requests (its rank 0's too) lost their KV and are re-dispatched to decode-0 with their
    streamed tokens kept (`driver.recompute`, their phases say how many), and complete with the tokens the
    same request gives on decode-0 alone; decode-0's two requests complete untouched."""

    async def scenario():
        routes: dict[str, RankRef] = {}
        tasks = {
            f"k{i}": asyncio.ensure_future(generate(cluster, f"k{i}", prompts[i], LONG, routes))
            for i in range(4)
        }
        deadline_s = time.monotonic() + request_bound_s(cluster)
        while len(routes) < 4:  # every request streaming
            assert time.monotonic() < deadline_s, routes
            await asyncio.sleep(0.01)
        assert sorted(routes.values()) == [RankRef(i, r) for i in (0, 1) for r in (0, 1)]
        ended_s: dict[str, float] = {}
        for rid, task in tasks.items():  # each request's own end, not when this loop got to it
            task.add_done_callback(lambda _, rid=rid: ended_s.setdefault(rid, time.monotonic()))
        ray_session.kill(cluster.instances["decode"][1].ranks[1])
        killed_s = time.monotonic()
        results, ended_after_s = {}, {}
        for rid, task in tasks.items():
            try:
                results[rid] = await asyncio.wait_for(task, request_bound_s(cluster))
            except BackendUnavailable as e:
                results[rid] = e
            ended_after_s[rid] = ended_s[rid] - killed_s
        return routes, results, ended_after_s

    routes, results, ended_after_s = run(cluster, scenario())
    for rid, route in routes.items():
        assert not isinstance(results[rid], BaseException), results[rid]
        tokens, last = results[rid]
        assert len(tokens) == LONG.max_tokens and last.finish_reason == "length"
        recomputed = last.phases.get("recomputed_tokens")
        assert (recomputed is not None) == (route.instance == 1), (rid, route, last.phases)
        assert recomputed is None or 1 <= recomputed < LONG.max_tokens
    assert cluster.registry.routable("decode") == [True, False]
    assert cluster.health()["decode-1"]["state"] == "dead"
    assert cluster.stats()["requests_recomputed_total"] == 2
    for rid in [rid for rid, route in routes.items() if route.instance == 1]:  # the same on decode-0 alone
        prompt = prompts[int(rid[1:])]
        again, _ = run(cluster, asyncio.wait_for(generate(cluster, f"again-{rid}", prompt, LONG), 240))
        assert again == results[rid][0], rid
    assert set(cluster.check_no_leaks()) == {"prefill-0", "prefill-0.1", "decode-0", "decode-0.1"}
    assert_nothing_held(cluster)


def test_a_stalled_rank_fails_its_instance_for_good(cluster, ray_session, prompts) -> None:
    """SIGSTOP of the rank of decode-0 that has no request while its peer runs one: the request ends with
    BackendUnavailable naming decode-0 within the call bounds (no hang) and decode-0 leaves routing. The
    peer's next collective times out (collective_timeout_s), so its group is broken: after SIGCONT decode-0
    does not rejoin but is declared dead, naming the failed instance group, within a probe or two."""
    import os
    import signal

    from pdcluster.driver.cluster import PROBE_INTERVAL_S

    async def first_delta():
        stream = cluster.generate("stalled", cluster.tokenizer.encode(prompts[0]), LONG)
        await stream.__anext__()
        return stream, cluster.dispatcher._requests["stalled"].attempt.decode

    stream, route = run(cluster, asyncio.wait_for(first_delta(), request_bound_s(cluster)))
    assert route.instance == 0  # decode-1 is dead since the test above
    idle_rank = cluster.instances["decode"][0].ranks[1 - route.rank]
    pid = ray_session.get(idle_rank.load.remote(), timeout=cluster.call_timeout_s).pid
    os.kill(pid, signal.SIGSTOP)
    stopped_s = time.monotonic()
    try:

        async def drain():
            async for _ in stream:
                pass

        # re-dispatched (`driver.recompute`) but no decode instance is left: a clear error, no hang
        lost = "decode-0 died or stopped answering .*its re-dispatch failed: .*no live decode instance"
        with pytest.raises(BackendUnavailable, match=lost):
            run(cluster, asyncio.wait_for(drain(), request_bound_s(cluster)))
        assert time.monotonic() - stopped_s < 2 * call_bound_s(cluster)
        assert cluster.health()["decode-0"]["state"] == "unresponsive"
        time.sleep(cluster.collective_timeout_s + call_bound_s(cluster))  # the peer's collective times out
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline_s = time.monotonic() + PROBE_INTERVAL_S + 2 * call_bound_s(cluster)
    while cluster.health()["decode-0"]["state"] != "dead":
        assert time.monotonic() < deadline_s, cluster.health()
        time.sleep(0.05)
    assert "instance group failed" in cluster.health()["decode-0"]["reason"]
    assert cluster.registry.routable("decode") == [False, False]
    with pytest.raises(BackendUnavailable, match="no live decode instance"):
        run(cluster, asyncio.wait_for(generate(cluster, "none-left", prompts[1], GREEDY), 60))
