"""Elastic EP growing back through faults, on a real local Ray cluster (`clusters/local-ep.yaml`: EP2
decode, gloo). Decode rank 1 is SIGKILLed and decode-0 shrinks onto rank 0. Growth 1: the survivor's switch
to the grown group fails (a fault injected at its "grow" checkpoint): its grow_group raises, the newcomer
is killed, decode-0 stays degraded on rank 0 and serves. Growth 2: the driver aborts after the survivor
agreed and switched (the abort injected before the driver takes the newcomer in): the newcomer is killed,
decode-0 shrinks again as after any rank loss. Growth 3 joins. Outputs equal one engine's throughout; the
health monitor's rounds keep their pace while the elastic worker re-forms and grows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from tests.cluster import test_cluster_elastic as base
from tests.cluster.test_cluster_elastic import GREEDY, generate, pid_of, ready_bound_s, run, shrink_bound_s

pytestmark = pytest.mark.slow
cluster, prompts, oracle = base.cluster, base.prompts, base.oracle  # (the fixtures)


def _wait_for(cluster, what, bound_s: float) -> dict:
    deadline_s = time.monotonic() + bound_s
    while not what(cluster.health()["decode-0"]):
        assert time.monotonic() < deadline_s, cluster.health()
        time.sleep(0.1)
    return cluster.health()["decode-0"]


def _serves(cluster, prompts, oracle, tag: str) -> None:
    for i, prompt in enumerate(prompts[:2]):
        assert (
            run(cluster, asyncio.wait_for(generate(cluster, f"{tag}{i}", prompt, GREEDY), 120)) == oracle[i]
        )


def test_growing_back_through_a_failed_switch_and_an_abort_after_agreement(
    cluster, ray_session, prompts, oracle, caplog
) -> None:
    oracle = oracle[0]
    elastic = cluster.monitor.elastic
    elastic.grow_after_s = float("inf")
    caplog.set_level(logging.WARNING, logger="pdcluster.driver.cluster")
    os.kill(pid_of(ray_session, cluster.instances["decode"][0].ranks[1], cluster), signal.SIGKILL)
    _wait_for(cluster, lambda h: h["state"] == "healthy" and h["recoveries"] == 1, shrink_bound_s(cluster))
    survivor = cluster.instances["decode"][0].ranks[0]

    # ---- growth 1: the survivor's switch fails ---------------------------------------------------------
    ray_session.get(survivor.inject_fault.remote("grow"), timeout=cluster.call_timeout_s)
    growths, joined = [], elastic._joined

    def abort_then_join(ray, instance, growth):  # growth 2: the abort reaches the driver after agreement
        if len(growths) == 2:
            elastic._abort_growth(ray, instance, growth, "injected: aborted after the survivors agreed")
        joined(ray, instance, growth)

    start = elastic._start_growth

    def start_recorded(ray, instance):
        start(ray, instance)
        growths.append(elastic.growing[(instance.role, instance.index)])

    elastic._start_growth, elastic._joined = start_recorded, abort_then_join
    elastic.grow_after_s = 0.0
    deadline_s = time.monotonic() + 2 * ready_bound_s(cluster)
    while not (len(growths) >= 2 or (growths and ("decode", 0) not in elastic.growing)):
        assert time.monotonic() < deadline_s, cluster.health()
        time.sleep(0.05)
    health = cluster.health()["decode-0"]
    assert (health["ranks"], health["degraded"], health["recoveries"], health["rejoins"]) == (1, True, 1, 0)
    with pytest.raises(ray_session.exceptions.ActorDiedError):  # the first newcomer was killed
        ray_session.get(growths[0].newcomers[0].load.remote(), timeout=2 * cluster.call_timeout_s)
    messages = [r.getMessage() for r in caplog.records]
    assert any("did not join" in m and "injected fault at grow" in m for m in messages), messages
    _serves(cluster, prompts, oracle, "degraded")

    # ---- growth 2: aborted after agreement: its newcomer killed, decode-0 shrinks again; growth 3 joins --
    health = _wait_for(
        cluster,
        lambda h: h["state"] == "healthy" and h["rejoins"] == 1,
        3 * ready_bound_s(cluster) + shrink_bound_s(cluster),
    )
    assert (health["ranks"], health["degraded"], health["recoveries"]) == (2, False, 2)
    assert len(growths) == 3, growths
    with pytest.raises(ray_session.exceptions.ActorDiedError):
        ray_session.get(growths[1].newcomers[0].load.remote(), timeout=2 * cluster.call_timeout_s)
    assert cluster.instances["decode"][0].ranks[1] is growths[2].newcomers[0]
    _serves(cluster, prompts, oracle, "grown")
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "a round failed" in m or "elastic EP step failed" in m], messages
