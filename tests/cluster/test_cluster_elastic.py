"""Elastic expert parallelism on a real local Ray cluster (one deployment, phases in order): one prefill and
one decode instance of 2 ranks each (EP2, 2 redundant experts, MTP k=1, gloo), as `clusters/local-ep.yaml`.

What it proves: SIGKILL of one decode rank under a steady stream of requests ends each request either
complete or with a clear error, none hangs; decode-0 is re-formed on its survivor (a world of 1 holding all
8 experts, the 3 it lacked read from the checkpoint) and serves again, greedy outputs equal to one engine's,
with /health's figures saying so. Then SIGSTOP of one prefill rank: the other's collective times out, the
prefill instance shrinks too and serves again; the idle re-formed decode group stepped through it all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from pdcluster.config import load_topology
from pdcluster.driver.backend import BackendUnavailable
from pdcluster.driver.cluster import PROBE_INTERVAL_S
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts
from tests.cluster.conftest import assert_nothing_held, call_bound_s, deployed_with_loop, request_bound_s

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
STREAM = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_def_prompts(4, min_chars=40, max_chars=200)


@pytest.fixture(scope="module")
def oracle(prompts):
    """One single-device engine (all experts local, MTP k=1): the greedy tokens the cluster must give."""
    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1)
    return [llm.generate([llm.tokenizer.encode(p)], GREEDY)[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def cluster(ray_session):
    topo = load_topology("clusters/local-ep.yaml")
    topo = dataclasses.replace(
        topo,
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
        decode=dataclasses.replace(topo.decode, kv_cache_memory_bytes=16 << 20, compile=False),
        # 10 s: the collective timeout (a stalled rank is given up on after it) and the handoff lease
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=10),
    )
    with deployed_with_loop(topo) as cluster:
        yield cluster


def run(cluster, coro):
    return cluster.test_loop.run_until_complete(coro)


async def generate(cluster, request_id: str, prompt: str, params: SamplingParams) -> list[int]:
    tokens = []
    async for delta in cluster.generate(request_id, cluster.tokenizer.encode(prompt), params):
        tokens += delta.new_token_ids
    return tokens


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


def test_a_lost_rank_shrinks_its_instance_which_serves_again(cluster, ray_session, prompts, oracle) -> None:
    elastic = cluster.monitor.elastic
    elastic.grow_after_s = float("inf")  # no replacement ranks until the last phase
    for i, prompt in enumerate(prompts[:2]):  # both decode ranks, before
        assert (
            run(cluster, asyncio.wait_for(generate(cluster, f"before{i}", prompt, GREEDY), 120)) == oracle[i]
        )

    # ---- SIGKILL of decode rank 1 under a steady stream ------------------------------------------------
    async def stream_and_kill():
        tasks, killed = [], False
        for i in range(12):
            tasks.append(asyncio.ensure_future(generate(cluster, f"s{i}", prompts[i % 4], STREAM)))
            await asyncio.sleep(0.3)
            if i == 3 and not killed:
                os.kill(pid_of(ray_session, cluster.instances["decode"][0].ranks[1], cluster), signal.SIGKILL)
                killed = True
        bound_s = request_bound_s(cluster) + shrink_bound_s(cluster)
        return await asyncio.gather(*(asyncio.wait_for(t, bound_s) for t in tasks), return_exceptions=True)

    results = run(cluster, stream_and_kill())
    assert not [r for r in results if isinstance(r, asyncio.TimeoutError)], results  # none hangs
    errors = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(e, BackendUnavailable) and "decode-0" in str(e) for e in errors), errors
    assert all(len(r) == STREAM.max_tokens for r in results if not isinstance(r, BaseException))
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
    for name in ("decode-0", "prefill-0"):
        deadline_s = time.monotonic() + 2 * ready_bound_s(cluster)
        while not (cluster.health()[name]["ranks"] == 2 and cluster.health()[name]["state"] == "healthy"):
            assert time.monotonic() < deadline_s, cluster.health()
            time.sleep(0.1)
        assert cluster.health()[name]["degraded"] is False and cluster.health()[name]["rejoins"] == 1
    assert cluster.instances["decode"][0].ranks[1] is not first.newcomers[0]

    async def concurrently():
        return await asyncio.gather(
            *(generate(cluster, f"grown{i}", p, GREEDY) for i, p in enumerate(prompts * 2)),
            return_exceptions=True,
        )

    assert run(cluster, asyncio.wait_for(concurrently(), 2 * request_bound_s(cluster))) == oracle * 2
    ranks = cluster.stats()["ranks"]
    for name in ("decode-0", "decode-0.1", "prefill-0", "prefill-0.1"):
        assert (ranks[name]["ep"]["num_ranks"], ranks[name]["ep"]["rank"]) == (2, int(name.endswith(".1")))
    assert_nothing_held(cluster)
