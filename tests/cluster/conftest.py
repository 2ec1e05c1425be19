"""One local Ray session per test module (clusters are deployed into it and torn down per test)."""

from __future__ import annotations

import pytest

from orchestrator.ray_runtime import init_local_ray


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        init_local_ray(num_cpus=4)
    yield ray
    if started:
        ray.shutdown()


# ---- waits derived from the cluster's configured timeouts ------------------------------------------------
# A test waits for what the cluster promises within its own timeouts (see orchestrator/cluster.py), never
# for "what is fast on an idle machine": under load everything is slower, but the timeouts still hold.


def call_bound_s(cluster) -> float:
    """How long one actor call on the request path (load, reserve, abort, poll) may take before the cluster
    itself gives up on it: `call_timeout_s`, plus one poll interval. A failure it detects (a dead actor) is
    reported within twice this."""
    return cluster.call_timeout_s + 0.5


def request_bound_s(cluster) -> float:
    """How long a request may run before a test calls it hung: each attempt waits at most
    `event_timeout_s` (kv_transfer.timeout_s + slack) for its next event, and a request may be attempted
    once per prefill instance; one more event timeout for the decode phase."""
    return cluster.event_timeout_s * (len(cluster.prefill_actors) + 1)
