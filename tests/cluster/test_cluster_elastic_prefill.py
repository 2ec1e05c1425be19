"""Elastic EP on a prefill instance, on a real local Ray cluster (`clusters/local-ep.yaml`: one prefill and
one decode instance of 2 ranks each, gloo): prefill rank 1 is SIGKILLed while prefills are in flight on
both ranks. The survivor's step fails with the group (its KV streams layer-wise: not rolled back), so every
in-flight prefill is re-dispatched with that reason, its instance not excluded: none fails though there is
no other prefill instance; prefill-0 re-forms on rank 0 and serves them, each with one engine's tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from tests.cluster import test_cluster_elastic as base
from tests.cluster.conftest import request_bound_s
from tests.cluster.test_cluster_elastic import GREEDY, generate, pid_of, run, shrink_bound_s, wait_shrunk

pytestmark = pytest.mark.slow
prompts, oracle, cluster = base.prompts, base.oracle, base.cluster  # (the fixtures)


def test_a_prefill_instance_losing_a_rank_serves_its_survivors_in_flight_prefills(
    cluster, ray_session, prompts, oracle, caplog
) -> None:
    oracle = oracle[0]
    cluster.monitor.elastic.grow_after_s = float("inf")
    caplog.set_level(logging.WARNING, logger="pdcluster.driver.cluster")
    pid = pid_of(ray_session, cluster.instances["prefill"][0].ranks[1], cluster)
    records = cluster.dispatcher._requests

    def prefilling(rank: int) -> list[str]:
        return [
            rid
            for rid, r in records.items()
            if r.attempt is not None
            and r.attempt.prefill.rank == rank
            and r.attempt.prefill_call is not None
            and not r.attempt.prefill_call.done()
        ]

    async def burst_and_kill():
        tasks, on_rank0, deadline_s = [], [], time.monotonic() + request_bound_s(cluster)
        while not on_rank0:  # bursts until both prefill ranks have prefills in flight
            assert time.monotonic() < deadline_s
            n = len(tasks)
            tasks += [
                asyncio.ensure_future(generate(cluster, f"p{n + i}", prompts[i % 4], GREEDY))
                for i in range(8)
            ]
            for _ in range(40):
                await asyncio.sleep(0.005)
                if prefilling(0) and prefilling(1):
                    on_rank0 = prefilling(0)
                    os.kill(pid, signal.SIGKILL)
                    break
            await asyncio.gather(*tasks[n:], return_exceptions=True) if not on_rank0 else None
        bound_s = request_bound_s(cluster) + shrink_bound_s(cluster)
        results = await asyncio.gather(*(asyncio.wait_for(t, bound_s) for t in tasks), return_exceptions=True)
        return on_rank0, results

    on_rank0, results = run(cluster, burst_and_kill())
    assert not [r for r in results if isinstance(r, BaseException)], results  # none failed, none hangs
    assert results == [oracle[i % 4] for i in range(len(results))]
    health = wait_shrunk(cluster, "prefill-0", 1)
    assert (health["ranks"], health["degraded"]) == (1, True)
    messages = [r.getMessage() for r in caplog.records]
    redispatched = [m for m in messages if "re-dispatched, its instance re-forming" in m]
    assert any(m.startswith(tuple(f"{rid}:" for rid in on_rank0)) for m in redispatched), messages
    for i, prompt in enumerate(prompts):  # served by the re-formed prefill-0
        assert (
            run(cluster, asyncio.wait_for(generate(cluster, f"after{i}", prompt, GREEDY), 120)) == oracle[i]
        )
