"""Elastic EP growing back when wiring a replacement fails, on a real local Ray cluster
(`clusters/local-ep.yaml`: EP2 decode, gloo). Decode rank 1 is SIGKILLed and decode-0 shrinks onto rank 0;
the first replacement joins the group but wiring its KV receiver fails (injected in the driver): it is a
rank of decode-0 by then (no second growth into its bundle), is killed, and decode-0 shrinks again as after
any rank loss; the next replacement joins. /metrics (`ApiMetrics` over the cluster's real stats) shows the
live ranks, the degraded state and the recoveries at each stage; outputs equal one engine's throughout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from prometheus_client import generate_latest

from pdcluster.entrypoints.openai.metrics import ApiMetrics
from tests.cluster import test_cluster_elastic as base
from tests.cluster.test_cluster_elastic import GREEDY, generate, pid_of, ready_bound_s, run, shrink_bound_s

pytestmark = pytest.mark.slow
cluster, prompts, oracle = base.cluster, base.prompts, base.oracle  # (the fixtures)


def _metrics(cluster) -> str:
    return generate_latest(ApiMetrics(cluster.stats).registry).decode()


def _assert_metrics(cluster, live_ranks: int, degraded: int, recoveries: int) -> None:
    text = _metrics(cluster)
    for line in (
        f'pdcluster_instance_live_ranks{{instance="decode-0"}} {live_ranks:.1f}',
        f'pdcluster_instance_degraded{{instance="decode-0"}} {degraded:.1f}',
        f'pdcluster_instance_recoveries_total{{instance="decode-0"}} {recoveries:.1f}',
        'pdcluster_instance_degraded{instance="prefill-0"} 0.0',
    ):
        assert line in text, (line, [t for t in text.splitlines() if t.startswith("pdcluster_instance")])


def _wait_for(cluster, what, bound_s: float) -> dict:
    deadline_s = time.monotonic() + bound_s
    while not what(cluster.health()["decode-0"]):
        assert time.monotonic() < deadline_s, cluster.health()
        time.sleep(0.1)
    return cluster.health()["decode-0"]


def test_a_replacement_whose_wiring_fails_is_killed_and_its_instance_shrinks_again(
    cluster, ray_session, prompts, oracle
) -> None:
    oracle = oracle[0]
    elastic = cluster.monitor.elastic
    elastic.grow_after_s = float("inf")
    _assert_metrics(cluster, 2, 0, 0)
    os.kill(pid_of(ray_session, cluster.instances["decode"][0].ranks[1], cluster), signal.SIGKILL)
    _wait_for(cluster, lambda h: h["state"] == "healthy" and h["recoveries"] == 1, shrink_bound_s(cluster))
    _assert_metrics(cluster, 1, 1, 1)

    failed, starts = [], []
    wire, start = elastic._wire_newcomers, elastic._start_growth

    def wire_fails_once(ray, instance, growth):  # the fault: the newcomer's receiver "did not start"
        if not failed:
            failed.append((growth.newcomers, list(instance.bundles), instance.num_ranks))
            raise RuntimeError("injected: the replacement's KV receiver did not start")
        wire(ray, instance, growth)

    def start_recorded(ray, instance):
        starts.append((cluster.health()["decode-0"]["recoveries"], list(instance.bundles)))
        start(ray, instance)

    elastic._wire_newcomers, elastic._start_growth = wire_fails_once, start_recorded
    elastic.grow_after_s = 0.0
    bound_s = ready_bound_s(cluster) + shrink_bound_s(cluster)
    health = _wait_for(cluster, lambda h: h["state"] == "healthy" and h["recoveries"] == 2, bound_s)
    assert (health["ranks"], health["rejoins"]) == (1, 0)
    newcomers, bundles, num_ranks = failed[0]
    assert (bundles, num_ranks) == ([0, 1], 2)  # a rank of decode-0 when its wiring failed
    with pytest.raises(ray_session.exceptions.ActorDiedError):
        ray_session.get(newcomers[0].load.remote(), timeout=2 * cluster.call_timeout_s)
    assert starts[0] == (1, [0]) and all(recoveries == 2 for recoveries, _ in starts[1:]), starts
    for i, prompt in enumerate(prompts[:2]):  # served by rank 0 alone meanwhile
        assert (
            run(cluster, asyncio.wait_for(generate(cluster, f"shrunk{i}", prompt, GREEDY), 120)) == oracle[i]
        )

    health = _wait_for(
        cluster, lambda h: h["state"] == "healthy" and h["rejoins"] == 1, 2 * ready_bound_s(cluster)
    )
    assert (health["ranks"], health["degraded"], health["recoveries"]) == (2, False, 2)
    assert [b for _, b in starts] == [[0], [0]], starts  # no growth into a bundle a rank held
    _assert_metrics(cluster, 2, 0, 2)

    async def concurrently():
        return await asyncio.gather(
            *(generate(cluster, f"grown{i}", p, GREEDY) for i, p in enumerate(prompts))
        )

    assert run(cluster, asyncio.wait_for(concurrently(), 120)) == oracle
