"""Elastic EP: a decode rank SIGKILLed in the middle of an EPLB rebalance, on a real local Ray cluster
(`clusters/local-ep.yaml`: EP2 decode, gloo). Rank 1 is held inside the rebalance every rank joined (after
the load allreduce, before moving expert weights) while requests stream on both ranks; it is killed
there. None hangs, every stream ends with one engine's tokens (rank 1's recomputed, rank 0's rolled back
and going on), decode-0 shrinks onto rank 0 and serves greedy outputs equal to one engine's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.cluster import test_cluster_elastic as base
from tests.cluster.conftest import assert_nothing_held, request_bound_s
from tests.cluster.test_cluster_elastic import (
    GREEDY,
    STREAM,
    generate,
    pid_of,
    ranks_at,
    run,
    shrink_bound_s,
    streamed,
    wait_shrunk,
)

pytestmark = pytest.mark.slow
cluster, prompts, oracle = base.cluster, base.prompts, base.oracle  # (the fixtures)


def test_a_rank_killed_mid_rebalance_shrinks_its_instance_which_serves_again(
    cluster, ray_session, prompts, oracle
) -> None:
    oracle, _, oracle_stream = oracle
    cluster.monitor.elastic.grow_after_s = float("inf")
    victim = cluster.instances["decode"][0].ranks[1]
    pid = pid_of(ray_session, victim, cluster)
    ray_session.get(victim.hold_next_rebalance.remote(shrink_bound_s(cluster)), timeout=60)

    async def stream_and_kill():
        tasks = [asyncio.ensure_future(streamed(cluster, f"rb{i}", prompts[i % 4], STREAM)) for i in range(6)]
        deadline_s = time.monotonic() + request_bound_s(cluster)
        while not ray_session.get(victim.rebalancing.remote(), timeout=cluster.call_timeout_s):
            assert time.monotonic() < deadline_s, "no rebalance began"
            await asyncio.sleep(0.05)
        at_kill = ranks_at(cluster)
        os.kill(pid, signal.SIGKILL)
        bound_s = request_bound_s(cluster) + shrink_bound_s(cluster)
        return at_kill, await asyncio.gather(
            *(asyncio.wait_for(t, bound_s) for t in tasks), return_exceptions=True
        )

    at_kill, results = run(cluster, stream_and_kill())
    assert not [r for r in results if isinstance(r, BaseException)], (at_kill, results)  # none hangs or errs
    for i, (tokens, text, _) in enumerate(results):
        assert (tokens, text) == (oracle_stream[i % 4].token_ids, oracle_stream[i % 4].text), i
    health = wait_shrunk(cluster, "decode-0", 1)
    assert (health["ranks"], health["deployed_ranks"], health["degraded"]) == (1, 2, True)
    ep = cluster.stats()["ranks"]["decode-0"]["ep"]
    assert (ep["num_ranks"], ep["rank"]) == (1, 0)
    for i, prompt in enumerate(prompts):  # served again by the survivor alone (all 8 experts)
        got = run(cluster, asyncio.wait_for(generate(cluster, f"after-rb{i}", prompt, GREEDY), 120))
        assert got == oracle[i], i
    assert_nothing_held(cluster)
