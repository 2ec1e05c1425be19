"""One local Ray session for the whole tests/cluster package (clusters are deployed into it and torn down
per test or per module; each module shuts down what it deployed, so the next one finds 4 free CPUs)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from pdcluster.driver.ray_runtime import init_local_ray


@pytest.fixture(scope="package")
def ray_session():
    """The Ray API with a local instance of 4 logical CPUs, started once for the package (a start and a
    shutdown cost seconds each, more under load); one already started by the caller is left running."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        init_local_ray(num_cpus=4)
    yield ray
    if started:
        ray.shutdown()


# ---- waits derived from the cluster's configured timeouts ------------------------------------------------
# A test waits for what the cluster promises within its own timeouts (pdcluster/driver/dispatch.py:
# call_timeout_s, event_timeout_s), never for "what is fast on an idle machine": under load everything is
# slower, but the timeouts still hold.


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


def assert_nothing_held(cluster) -> dict:
    """Wait until no instance holds anything (KV blocks, reservations, open handoffs, unfinished or active
    requests), then return the snapshots; AssertionError with them if that takes longer than
    `event_timeout_s` (releases are actor calls bounded by call_timeout_s; a reservation whose handoff never
    came is dropped when its lease, kv_transfer.timeout_s, ends)."""
    deadline_s = time.monotonic() + cluster.event_timeout_s
    while True:
        leaks = cluster.check_no_leaks()
        idle = all(
            r["num_used_blocks"] == 0
            and not r["pending_handoffs"]
            and not r.get("num_reserved", 0)
            and not r.get("num_unfinished", 0)
            and not r.get("num_active", 0)
            for r in leaks.values()
        )
        if idle or time.monotonic() > deadline_s:
            break
        time.sleep(0.1)
    assert idle, leaks
    return leaks


@contextlib.contextmanager
def deployed_with_loop(topology, **deploy_kwargs):
    """`Cluster.deploy(topology)` with one event loop of its own, `cluster.test_loop`, for a module's tests:
    the decode pollers live on the loop of the first request, so a poll in flight when an `asyncio.run`
    loop closes would take the next request's events with it. Shut down (and the loop closed) on exit."""
    from pdcluster.driver.cluster import Cluster

    cluster = Cluster.deploy(topology, **deploy_kwargs)
    cluster.test_loop = asyncio.new_event_loop()
    try:
        yield cluster
    finally:
        cluster.shutdown()
        pending = asyncio.all_tasks(cluster.test_loop)
        for task in pending:
            task.cancel()
        cluster.test_loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        cluster.test_loop.close()
