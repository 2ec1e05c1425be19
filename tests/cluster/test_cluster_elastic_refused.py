"""Elastic EP refusing to shrink, on a real local Ray cluster: two EP2 decode instances (8 experts + 2
redundant: 5 slots per rank, gloo) behind a one-rank prefill. The driver's per-rank expert-slot limit for
decode is set to the 5 slots deployed (the fault: a device whose memory holds no more; this CPU's budget
allows all 8), and decode-0's rank 1 is SIGKILLed while requests stream on both instances. The survivor
refuses the re-placement before any new group forms: decode-0 is dead with the refusal as its /health
reason, every request completes with one engine's tokens (re-dispatched) or ends with an error naming the
refusal, none hangs; decode-1 keeps serving and the health monitor's rounds never fail.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from pdcluster.driver.cluster import PROBE_INTERVAL_S
from tests.cluster import test_cluster_elastic as base
from tests.cluster.conftest import deployed_with_loop, request_bound_s
from tests.cluster.test_cluster_elastic import GREEDY, STREAM, generate, pid_of, run, shrink_bound_s, streamed

pytestmark = pytest.mark.slow
prompts, oracle = base.prompts, base.oracle  # (the fixtures)


def test_a_refused_re_placement_fails_the_instance_and_the_others_keep_serving(
    ray_session, prompts, oracle, caplog
) -> None:
    oracle, _, oracle_stream = oracle
    topo = base.five_device_topology(num_instances=2)
    caplog.set_level(logging.WARNING, logger="pdcluster.driver.cluster")
    with deployed_with_loop(topo) as cluster:
        elastic = cluster.monitor.elastic
        elastic.grow_after_s = float("inf")
        assert elastic.survivor_slots("decode") == 8  # the CPU device's budget: every logical expert
        elastic.max_local_experts["decode"] = 5  # the fault: no room beyond the deployed slots
        pid = pid_of(ray_session, cluster.instances["decode"][0].ranks[1], cluster)
        records = cluster.dispatcher._requests
        ids = [f"refused-{i}" for i in range(8)]

        async def stream_and_kill():
            tasks = [
                asyncio.ensure_future(streamed(cluster, rid, prompts[i % 4], STREAM))
                for i, rid in enumerate(ids)
            ]
            deadline_s = time.monotonic() + request_bound_s(cluster)
            while True:  # until decode-0's rank 1 streams a request and decode-1 another
                at = {
                    r.attempt.decode for r in records.values() if r.attempt and len(r.streamed_token_ids) >= 2
                }
                if (0, 1) in at and any(d.instance == 1 for d in at):
                    break
                assert time.monotonic() < deadline_s, at
                await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            bound_s = request_bound_s(cluster) + shrink_bound_s(cluster)
            return await asyncio.gather(
                *(asyncio.wait_for(t, bound_s) for t in tasks), return_exceptions=True
            )

        results = run(cluster, stream_and_kill())
        assert not [r for r in results if isinstance(r, asyncio.TimeoutError)], results  # none hangs
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                assert "cannot shrink" in str(result) and "PlacementRefused" in str(result), result
            else:
                assert result[:2] == (oracle_stream[i % 4].token_ids, oracle_stream[i % 4].text), i
        deadline_s = time.monotonic() + shrink_bound_s(cluster)
        while cluster.health()["decode-0"]["state"] != "dead" or not elastic._given_up:
            assert time.monotonic() < deadline_s, cluster.health()
            time.sleep(0.1)
        health = cluster.health()
        reason = health["decode-0"]["reason"]
        assert "lost rank(s) [1] and cannot shrink" in reason and "PlacementRefused" in reason, reason
        assert "5 expert slots cannot hold 8 logical experts" in reason, reason
        assert health["decode-0"]["recoveries"] == 0 and health["decode-1"]["state"] == "healthy"
        for i, prompt in enumerate(prompts):  # decode-1 serves
            got = run(cluster, asyncio.wait_for(generate(cluster, f"after{i}", prompt, GREEDY), 120))
            assert got == oracle[i], i
        time.sleep(3 * PROBE_INTERVAL_S)  # more probe rounds over the dead instance
        assert cluster.health()["decode-0"]["reason"] == reason
        messages = [r.getMessage() for r in caplog.records]
        assert any("cannot shrink onto the survivors" in m for m in messages), messages
        assert not [m for m in messages if "a round failed" in m], messages
