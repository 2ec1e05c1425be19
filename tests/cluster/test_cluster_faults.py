"""Faults on a real local Ray cluster (one deployment shared by the module): requests that finish at
admission on decode, more concurrent handoffs than decode's max_num_seqs, and exceptions on the decode
and prefill engine threads. Faults are injected only
through the actors' test-only `inject_fault` hook; everything else is the real cluster.

Every request runs under a timeout: the failure these tests guard against is a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdcluster.config import load_topology
from pdcluster.driver.backend import BackendUnavailable
from pdcluster.driver.cluster import Cluster
from pdcluster.driver.messages import DecodeNodeLoad, PrefillNodeLoad
from pdcluster.engine.sampling_params import SamplingParams
from tests.cluster.conftest import assert_nothing_held, deployed_with_loop, request_bound_s

pytestmark = pytest.mark.slow

PROMPT = "def add(a, b):\n    return"
DECODE_MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def cluster(ray_session):
    topo = load_topology("clusters/local.yaml")
    topo = dataclasses.replace(
        topo,
        kv_transfer=dataclasses.replace(topo.kv_transfer, transport="grpc", timeout_s=10),
        decode=dataclasses.replace(
            topo.decode,
            num_speculative_tokens=1,
            kv_cache_memory_bytes=16 << 20,
            max_num_seqs=DECODE_MAX_NUM_SEQS,
            compile=False,  # eager: only test_cluster_compiled.py compiles (tests/conftest.py)
        ),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
    )
    with deployed_with_loop(topo) as cluster:
        yield cluster


def _generate(cluster: Cluster, request_id: str, params: SamplingParams, prompt: str = PROMPT):
    """(tokens, last delta), or the exception the stream raised; TimeoutError means it hung."""

    async def run():
        tokens, last = [], None
        async for delta in cluster.generate(request_id, cluster.tokenizer.encode(prompt), params):
            tokens += delta.new_token_ids
            last = delta
        return tokens, last

    return cluster.test_loop.run_until_complete(asyncio.wait_for(run(), request_bound_s(cluster)))


def _assert_no_leaks(cluster: Cluster) -> None:
    assert_nothing_held(cluster)


def _healthy_request_completes(cluster: Cluster, request_id: str) -> None:
    tokens, last = _generate(
        cluster, request_id, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    assert len(tokens) == 6 and last.finished and last.finish_reason == "length"


def test_request_finished_at_admission_completes_on_an_idle_decode(cluster) -> None:
    """max_tokens=1 (and a first token that is a stop token) finishes the request when decode admits
    it; with nothing else running, its final delta must still come (it hung: nothing stepped)."""
    tokens, last = _generate(cluster, "one", SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert len(tokens) == 1
    assert last.finished and last.finish_reason == "length"
    assert "kv_transfer_s" in last.phases and "first_decode_step_s" in last.phases
    _assert_no_leaks(cluster)

    # The same first token as a stop token (as EOS would): finished at admission, reason "stop".
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(tokens[0],))
    stopped, last = _generate(cluster, "stop-first", params)
    assert stopped == tokens and last.finished and last.finish_reason == "stop"
    _assert_no_leaks(cluster)


def test_more_concurrent_streams_than_decode_max_num_seqs_all_complete(cluster) -> None:
    """Issue 12, finding 1: with more handoffs in flight than decode's max_num_seqs, the excess waits for
    a seat on decode; every stream completes. Before, admissions overfilled the batch and the step failed
    every request ("decode step failed: ... exceeds the input buffers")."""
    num_requests = 3 * DECODE_MAX_NUM_SEQS
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def one(i: int) -> tuple[int, str | None]:
        ids = cluster.tokenizer.encode(f"{PROMPT} {i}")
        tokens, last = [], None
        async for delta in cluster.generate(f"concurrent-{i}", ids, params):
            tokens += delta.new_token_ids
            last = delta
        return len(tokens), last.finish_reason

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(num_requests)))

    results = cluster.test_loop.run_until_complete(asyncio.wait_for(run_all(), request_bound_s(cluster)))
    assert results == [(12, "length")] * num_requests
    _assert_no_leaks(cluster)


@pytest.mark.parametrize("where", ["admit", "delta", "loop"])
def test_decode_engine_thread_exception_fails_the_request_and_the_loop_survives(cluster, where) -> None:
    """An exception on decode's engine thread (admitting a handoff, turning step outputs into deltas, or
    the loop itself) becomes an error for the request (the stream raises BackendUnavailable, or the
    cluster re-dispatches it before any token and it completes); blocks are freed, the error is counted
    in load(), and the next request is served by the same thread. It used to kill the thread: a hang."""
    decode = cluster.decode_actors[0]
    errors_before = cluster_load(cluster, decode).num_engine_errors
    _ray_get(cluster, decode.inject_fault.remote(where))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        tokens, last = _generate(cluster, f"fault-{where}", params)
    except BackendUnavailable as e:
        assert request_id_in(e, f"fault-{where}")  # failed fast, no hang
    else:  # an error before the first token: re-dispatched, and the retry is served
        assert len(tokens) == 6 and last.finished
    load = cluster_load(cluster, decode)
    assert load.engine_thread_alive and load.num_engine_errors > errors_before
    _assert_no_leaks(cluster)
    _healthy_request_completes(cluster, f"after-{where}")
    _assert_no_leaks(cluster)


@pytest.mark.parametrize("where", ["start", "step", "complete"])
def test_prefill_engine_thread_exception_fails_the_request_and_the_loop_survives(cluster, where) -> None:
    """An exception on prefill's engine thread fails that request's prefill (its handoff is aborted, so
    decode frees its reservation at once) and the loop serves the next request."""
    prefill = cluster.prefill_actors[0]
    errors_before = cluster_load(cluster, prefill).num_engine_errors
    _ray_get(cluster, prefill.inject_fault.remote(where))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        tokens, last = _generate(cluster, f"prefill-fault-{where}", params)
    except BackendUnavailable as e:
        assert request_id_in(e, f"prefill-fault-{where}")  # failed fast, no hang
        # Issue 12, finding 7: with one prefill the client hears the attempt's cause, not only "no live
        # prefill instance left to dispatch to" (prefill-0 is alive), and no Ray internals.
        assert f"injected fault at {where}" in str(e), e
        assert "pid=" not in str(e) and "actor_id" not in str(e), e
    else:  # re-dispatched after the failed attempt
        assert len(tokens) == 4 and last.finished
    load = cluster_load(cluster, prefill)
    assert load.engine_thread_alive and load.num_engine_errors > errors_before
    _assert_no_leaks(cluster)
    _healthy_request_completes(cluster, f"prefill-after-{where}")
    _assert_no_leaks(cluster)


def cluster_load(cluster: Cluster, actor) -> PrefillNodeLoad | DecodeNodeLoad:
    return _ray_get(cluster, actor.load.remote())


def _ray_get(cluster: Cluster, ref):
    import ray

    return ray.get(ref, timeout=cluster.call_timeout_s)  # what the cluster itself allows one call


def request_id_in(error: Exception, request_id: str) -> bool:
    return request_id in str(error)
