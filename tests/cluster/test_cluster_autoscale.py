"""Dynamic P:D on a real local Ray cluster: single-device instances change role in place while serving
(`driver.role_moves`, `workers.role_rank`). ONE deployment (2 prefill + 1 decode of the bundled model, shm)
runs the scenarios in file order: a refused move, moves in both directions with requests in flight, a move
during a handoff, and last a move whose actor is killed."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray

from pdcluster.config import load_topology
from pdcluster.config.autoscale import AutoscaleConfig
from pdcluster.driver.backend import BackendUnavailable
from pdcluster.driver.role_moves import MoveFailed, MoveRefused
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from tests.cluster.conftest import assert_nothing_held, call_bound_s, deployed_with_loop, request_bound_s
from tests.faults import FAULT_WORKERS

pytestmark = pytest.mark.slow

PROMPTS = [
    "def add(a, b):\n    return",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(",
    "import os\nimport sys\n\n\ndef main(argv):\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _topology():
    topo = load_topology("clusters/local.yaml")
    return dataclasses.replace(
        topo,
        hardware=dataclasses.replace(topo.hardware, devices_per_node=3),
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=20),
        prefill=dataclasses.replace(topo.prefill, num_instances=2, kv_cache_memory_bytes=16 << 20),
        decode=dataclasses.replace(topo.decode, kv_cache_memory_bytes=16 << 20, compile=False),
        autoscale=AutoscaleConfig(enabled=True, controller=False, drain_timeout_s=60.0),  # moves by hand
    )


@pytest.fixture(scope="module")
def reference():
    """Greedy token ids of one engine (no disaggregation), one request at a time: the oracle."""
    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return ids, [llm.generate([i], GREEDY)[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def cluster(ray_session):
    with deployed_with_loop(_topology(), worker_classes=FAULT_WORKERS) as deployed:
        yield deployed


def _run(cluster, coro):
    return cluster.test_loop.run_until_complete(coro)


async def _generate(cluster, request_id: str, ids: list[int]) -> list[int]:
    tokens: list[int] = []
    async for delta in cluster.generate(request_id, ids, GREEDY):
        tokens += delta.new_token_ids
    return tokens


async def _all(cluster, tag: str, prompts: list[list[int]]) -> list[list[int]]:
    return await asyncio.gather(*(_generate(cluster, f"{tag}{i}", p) for i, p in enumerate(prompts)))


async def _move_with_requests_in_flight(cluster, reference, tag: str, name: str, role: str):
    """Requests started before the move (decoding when it begins) and during it; the move's result and
    every request's tokens."""
    ids, _ = reference
    loop = asyncio.get_running_loop()
    before = [asyncio.ensure_future(_generate(cluster, f"{tag}-a{i}", p)) for i, p in enumerate(ids)]
    source = cluster.mover.find(name)
    deadline_s = time.monotonic() + request_bound_s(cluster)
    while not any(  # decoding now (on the moving instance when it is a decode one)
        r.decode_streamed and (source.role == "prefill" or r.attempt.decode_index == source.index)
        for r in list(cluster.dispatcher._requests.values())
        if r.attempt is not None
    ):
        assert time.monotonic() < deadline_s, "no request reached decode"
        await asyncio.sleep(0.002)
    move = loop.run_in_executor(None, cluster.mover.move, name, role, f"test: {tag}")
    await asyncio.sleep(0.05)
    during = [asyncio.ensure_future(_generate(cluster, f"{tag}-b{i}", p)) for i, p in enumerate(ids)]
    outputs = await asyncio.wait_for(asyncio.gather(*before, *during), 2 * request_bound_s(cluster))
    return await asyncio.wait_for(move, cluster.topology.autoscale.drain_timeout_s + 60), outputs


def test_a_move_that_would_empty_a_pool_or_repeat_a_role_is_refused(cluster, monkeypatch) -> None:
    """Through the admin endpoint (its token, not the API key) and the mover: nothing changes."""
    from fastapi.testclient import TestClient

    from pdcluster.entrypoints.openai.app import build_app

    monkeypatch.delenv("PDCLUSTER_ADMIN_TOKEN", raising=False)
    client = TestClient(build_app(cluster, api_key="user-key", admin_token="admin-token"))
    url, body = "/admin/instances/decode-0/role", {"role": "prefill"}
    assert client.post(url, json=body).status_code == 401
    assert client.post(url, json=body, headers={"Authorization": "Bearer user-key"}).status_code == 403
    admin = {"Authorization": "Bearer admin-token"}
    refused = client.post(url, json=body, headers=admin)
    assert refused.status_code == 409, refused.text
    assert "would leave the decode pool empty" in refused.json()["error"]["message"]
    assert client.post(url, json={"role": "standby"}, headers=admin).status_code == 400
    assert client.post("/admin/instances/decode-9/role", json=body, headers=admin).status_code == 404
    listed = client.get("/admin/instances", headers=admin).json()
    assert listed["movable"] and [i["name"] for i in listed["instances"]] == [
        "prefill-0",
        "prefill-1",
        "decode-0",
    ]
    metrics = client.get("/metrics").text
    assert 'pdcluster_instance_role{instance="prefill-1",role="prefill"} 1.0' in metrics
    with pytest.raises(MoveRefused, match="would leave the decode pool empty"):
        cluster.mover.move("decode-0", "prefill", "test")
    with pytest.raises(MoveRefused, match="already a prefill instance"):
        cluster.mover.move("prefill-0", "prefill", "test")
    with pytest.raises(KeyError, match="no instance 'decode-7'"):
        cluster.mover.move("decode-7", "prefill", "test")
    assert cluster.mover.roles() == {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
    assert sum(cluster.mover.moves.values()) == 0


def test_prefill_to_decode_with_requests_in_flight(cluster, reference) -> None:
    """prefill-1 drains its queue and becomes decode-1 (same actor, same process); every request, before
    and during the move, gives the single engine's tokens; later requests also decode on it."""
    pid = ray.get(cluster.instances["prefill"][1].leader.load.remote()).pid
    result, outputs = _run(
        cluster, _move_with_requests_in_flight(cluster, reference, "p2d", "prefill-1", "decode")
    )
    assert result["name"] == "decode-1" and result["role"] == "decode"
    assert outputs == reference[1] * 2
    slot = cluster.instances["decode"][1]
    assert slot.accepting and ray.get(slot.leader.role.remote()) == "decode"
    assert ray.get(slot.leader.load.remote()).pid == pid  # in place: no new process, no reload
    assert cluster.mover.roles() == {"prefill-0": "prefill", "prefill-1": "decode", "decode-0": "decode"}
    assert cluster.mover.moves[("prefill", "decode", "manual")] == 1
    # both decode instances take new requests
    outputs = _run(cluster, _all(cluster, "p2d-c", reference[0] * 2))
    assert outputs == reference[1] * 2
    assert_nothing_held(cluster)


def test_decode_to_prefill_with_requests_in_flight(cluster, reference) -> None:
    """decode-0 stops admitting, finishes its running requests, becomes prefill-2."""
    result, outputs = _run(
        cluster, _move_with_requests_in_flight(cluster, reference, "d2p", "decode-0", "prefill")
    )
    assert (result["name"], result["instance"]) == ("prefill-2", "decode-0")
    assert "requests decoding" in result["drained"]  # it had running requests to finish
    assert outputs == reference[1] * 2
    assert cluster.mover.roles() == {"prefill-0": "prefill", "prefill-1": "decode", "decode-0": "prefill"}
    assert [s.name for s in cluster.instances["prefill"] if s.accepting] == ["prefill-0", "prefill-2"]
    with pytest.raises(MoveRefused, match="would leave the decode pool empty"):
        cluster.mover.move("prefill-1", "prefill", "test")  # its deploy name; now the only decode
    from fastapi.testclient import TestClient

    from pdcluster.entrypoints.openai.app import build_app

    metrics = TestClient(build_app(cluster)).get("/metrics").text
    for line in (
        'pdcluster_instance_role{instance="decode-0",role="prefill"} 1.0',
        'pdcluster_role_moves_total{from_role="prefill",to_role="decode",trigger="manual"} 1.0',
        'pdcluster_role_moves_total{from_role="decode",to_role="prefill",trigger="manual"} 1.0',
    ):
        assert line in metrics, metrics
    assert_nothing_held(cluster)


def test_a_move_during_a_handoff(cluster, reference) -> None:
    """The decode rank holds each reserve's answer a while (the prefill job waits for its bind): the prefill
    instance moved meanwhile finishes that handoff before it switches; the request completes intact."""
    ids, expected = reference
    decode = cluster.instances["decode"][1].leader
    ray.get(decode.inject_delay.remote("after_reserve", 1.0, 2))

    async def run():
        loop = asyncio.get_running_loop()
        request = asyncio.ensure_future(_generate(cluster, "handoff-0", ids[0]))
        deadline_s = time.monotonic() + 2 * call_bound_s(cluster)
        while (record := cluster.dispatcher._requests.get("handoff-0")) is None or record.attempt is None:
            assert time.monotonic() < deadline_s, "the request was never routed"
            await asyncio.sleep(0.002)
        name = f"prefill-{record.attempt.prefill_index}"
        move = loop.run_in_executor(None, cluster.mover.move, name, "decode", "test: during a handoff")
        return await asyncio.wait_for(asyncio.gather(request, move), 2 * request_bound_s(cluster))

    tokens, result = _run(cluster, run())
    assert tokens == expected[0] and result["role"] == "decode"
    assert_nothing_held(cluster)


def test_the_controller_moves_live_from_the_signals(cluster, reference) -> None:
    """`LiveAutoscaler` over this cluster: prompts arriving faster than the (here fixed, tiny) prefill
    capacity make the prefill pool's utilization the peak, so one tick moves a decode instance to prefill
    and records it as a controller move; the requests around it complete intact."""
    from pdcluster.driver.autoscale import Capacity
    from pdcluster.driver.autoscale_live import LiveAutoscaler

    ids, expected = reference
    config = dataclasses.replace(cluster.topology.autoscale, window_s=2.0, interval_s=1.0, dwell_s=30.0)
    cluster.topology = dataclasses.replace(cluster.topology, autoscale=config)
    decodes_before = [s.home for s in cluster.instances["decode"] if s.accepting]
    assert len(decodes_before) == 2, decodes_before
    # priced so that these prompts alone need more prefill instances than there are (a test's price)
    # its clock a dwell ahead: the manual moves above are a dwell in the past (no reversal within one)
    autoscaler = LiveAutoscaler(
        cluster,
        capacity=lambda context, prompt: Capacity(1.0, 64.0),
        clock=lambda: time.monotonic() + config.dwell_s,
    )
    cluster.autoscaler = autoscaler

    async def run():
        started_s = time.monotonic()
        first = await _all(cluster, "ctl-", ids)
        await asyncio.sleep(max(0.0, started_s + config.window_s - time.monotonic()))  # a whole window
        second = asyncio.ensure_future(_all(cluster, "ctl-in-flight-", ids))  # their prompts in the window
        await asyncio.sleep(0.05)
        move = await asyncio.get_running_loop().run_in_executor(None, autoscaler.tick)
        return first + await second, move

    try:
        outputs, move = _run(cluster, run())
    finally:
        cluster.autoscaler = None
    assert outputs == expected * 2
    assert move is not None and (move.source, move.target) == ("decode", "prefill"), autoscaler.decisions
    assert autoscaler.decisions[-1][2] == "done"
    assert cluster.mover.moves[("decode", "prefill", "controller")] == 1
    assert len([s for s in cluster.instances["decode"] if s.accepting]) == 1
    assert _run(cluster, _all(cluster, "ctl-after-", ids)) == expected


def test_a_decode_instance_past_its_drain_bound_hands_its_requests_over(cluster, reference) -> None:
    """A drain bound shorter than the running requests: at the bound they are re-dispatched through
    prefill with their streamed tokens kept (counted as recomputed, not silently), the move completes, and
    each request still gives the single engine's tokens."""
    ids, expected = reference
    if len([s for s in cluster.instances["decode"] if s.accepting]) < 2:
        source = next(s for s in cluster.instances["prefill"] if s.accepting)
        cluster.mover.move(source.name, "decode", "test: a second decode instance")
    recomputed_before = cluster.dispatcher.requests_recomputed_total
    name = next(s for s in cluster.instances["decode"] if s.accepting).name
    cluster.mover.drain_timeout_s = 0.01
    try:
        result, outputs = _run(
            cluster, _move_with_requests_in_flight(cluster, reference, "bound", name, "prefill")
        )
    finally:
        cluster.mover.drain_timeout_s = cluster.topology.autoscale.drain_timeout_s
    assert result["role"] == "prefill" and "requests decoding" in result["drained"]
    assert outputs == expected * 2
    assert cluster.dispatcher.requests_recomputed_total > recomputed_before
    assert_nothing_held(cluster)


def test_a_parked_instance_takes_no_traffic_and_serves_again_when_unparked(cluster, reference) -> None:
    """Parking prefill A with requests in flight: they complete, A stays loaded (same process) and in its
    pool but out of routing, so the next requests all go to B; unparked, A serves again (B parked in turn
    leaves it the only prefill). Every request gives the single engine's tokens; /metrics says parked."""
    from fastapi.testclient import TestClient

    from pdcluster.entrypoints.openai.app import build_app

    ids, expected = reference
    while len(prefills := [s for s in cluster.instances["prefill"] if s.accepting]) < 2:
        back = next(s for s in cluster.instances["decode"] if s.accepting and s.num_ranks == 1)
        cluster.mover.move(back.name, "prefill", "test: two prefill instances to park one")
    a, b = prefills[:2]
    pid = ray.get(a.leader.load.remote()).pid

    def prefill_indices(tag: str) -> set[int]:
        return {
            r.attempt.prefill_index
            for rid, r in list(cluster.dispatcher._requests.items())
            if rid.startswith(tag) and r.attempt is not None
        }

    async def park_with_requests_in_flight():
        loop = asyncio.get_running_loop()
        before = asyncio.ensure_future(_all(cluster, "park-a", ids * 2))
        await asyncio.sleep(0.05)
        park = loop.run_in_executor(None, cluster.mover.move, a.name, "parked", "test: park")
        outputs = await asyncio.wait_for(before, 2 * request_bound_s(cluster))
        return await asyncio.wait_for(park, cluster.topology.autoscale.drain_timeout_s + 60), outputs

    result, outputs = _run(cluster, park_with_requests_in_flight())
    assert outputs == expected * 2 and result["role"] == "parked"
    assert a.pool_state == "parked" and a.routable and not a.accepting
    assert ray.get(a.leader.load.remote()).pid == pid  # kept loaded: no new process
    assert cluster.mover.roles()[a.home] == "parked"
    metrics = TestClient(build_app(cluster)).get("/metrics").text
    assert f'pdcluster_instance_role{{instance="{a.home}",role="parked"}} 1.0' in metrics, metrics

    async def watched(tag: str):  # the records stay while their streams run: read them then
        task = asyncio.ensure_future(_all(cluster, tag, ids * 2))
        seen: set[int] = set()
        while not task.done():
            seen |= prefill_indices(tag)
            await asyncio.sleep(0.001)
        return await task, seen

    outputs, used = _run(cluster, watched("parked-"))
    assert outputs == expected * 2 and used == {b.index}, used
    with pytest.raises(MoveRefused, match="already parked"):
        cluster.mover.move(a.name, "parked", "test")
    with pytest.raises(MoveRefused, match="would leave the prefill pool empty"):
        cluster.mover.move(b.name, "parked", "test")  # A parked: B is the only prefill in routing

    assert cluster.mover.move(a.name, a.role, "test: unpark")["role"] == "prefill"
    assert a.accepting and cluster.mover.moves[("parked", "prefill", "manual")] == 1
    cluster.mover.move(b.name, "parked", "test: park the other")
    outputs, used = _run(cluster, watched("unparked-"))
    assert outputs == expected * 2 and used == {a.index}, used
    cluster.mover.move(b.name, "prefill", "test: unpark the other")
    assert a.accepting and b.accepting
    assert cluster.mover.moves[("prefill", "parked", "manual")] == 2
    assert_nothing_held(cluster)


def test_the_moving_actor_killed_mid_drain(cluster, reference) -> None:
    """The moving prefill instance's actor is killed while it drains: the move fails naming it, and every
    request completes with the single engine's tokens or fails with a clear error (none hangs)."""
    ids, expected = reference
    source = next(s for s in cluster.instances["prefill"] if s.accepting)
    others = [s for s in cluster.instances["prefill"] if s.accepting and s is not source]
    if not others:  # keep a prefill instance to re-dispatch to: move one back first
        back = next(s for s in cluster.instances["decode"] if s.accepting)
        cluster.mover.move(back.name, "prefill", "test: refill the prefill pool")

    async def run():
        loop = asyncio.get_running_loop()
        requests = [asyncio.ensure_future(_generate(cluster, f"kill-{i}", p)) for i, p in enumerate(ids * 2)]
        await asyncio.sleep(0.05)
        move = loop.run_in_executor(None, cluster.mover.move, source.name, "decode", "test: killed")
        deadline_s = time.monotonic() + 2 * call_bound_s(cluster)
        while source.pool_state != "draining" and not move.done():
            assert time.monotonic() < deadline_s
            await asyncio.sleep(0.001)
        ray.kill(source.leader, no_restart=True)
        done = await asyncio.wait_for(
            asyncio.gather(*requests, return_exceptions=True), 2 * request_bound_s(cluster)
        )
        try:
            await asyncio.wait_for(move, cluster.topology.autoscale.drain_timeout_s + 60)
        except MoveFailed as e:
            return done, e
        return done, None

    done, failure = _run(cluster, run())
    for out, want in zip(done, expected * 2, strict=True):
        if isinstance(out, BaseException):
            assert isinstance(out, BackendUnavailable) and str(out), out
        else:
            assert out == want
    if failure is not None:  # (else it drained and switched before the kill reached it)
        assert source.name in str(failure)
    assert sum(cluster.mover.failed.values()) == (failure is not None)
