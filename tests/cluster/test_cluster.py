"""End to end on a real local Ray cluster with the bundled tiny model (each test says what it proves)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from pdcluster.config import KVTLSConfig, load_topology
from pdcluster.driver.backend import PHASE_NAMES, BackendUnavailable, ServingBackend
from pdcluster.driver.cluster import Cluster
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.workers.thread_clock import run_delay_s
from tests.cluster.conftest import assert_nothing_held, call_bound_s, request_bound_s
from tests.kvtransfer.conftest import write_test_certificates

pytestmark = pytest.mark.slow

PROMPTS = [
    "def add(a, b):\n    return",
    'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the arguments and',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):\n    if i % 2 == 0:\n        print(",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _topology(transport: str = "grpc", layerwise: bool = True, k: int = 1, tls=None, **pools):
    topo = load_topology("clusters/local.yaml")
    topo = dataclasses.replace(
        topo,
        kv_transfer=dataclasses.replace(
            topo.kv_transfer, transport=transport, layerwise=layerwise, timeout_s=20, tls=tls
        ),
        decode=dataclasses.replace(  # eager: only test_cluster_compiled.py compiles (tests/conftest.py)
            topo.decode, num_speculative_tokens=k, kv_cache_memory_bytes=16 << 20, compile=False
        ),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20, **pools),
    )
    if pools.get("num_instances", 1) > 1:
        topo = dataclasses.replace(topo, hardware=dataclasses.replace(topo.hardware, devices_per_node=3))
    return topo


@pytest.fixture(scope="module")
def single_engine_outputs():
    """Greedy outputs of one engine (no disaggregation), per k: the oracle."""
    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1)
    results = {}
    for k in (0, 1):
        engine = llm if k == 1 else llm.replace_config(num_speculative_tokens=0)
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        # One at a time: each request's numerics do not depend on its batch mates.
        results[k] = [engine.generate([i], GREEDY)[0] for i in ids]
    # A stop string inside the first prompt's greedy text: decode's engine cuts the text there.
    stop = stopped_stop(results)[0]
    for k in (0, 1):
        engine = llm if k == 1 else llm.replace_config(num_speculative_tokens=0)
        stopped = dataclasses.replace(GREEDY, stop=(stop,))
        results["stop", k] = engine.generate([engine.tokenizer.encode(PROMPTS[0])], stopped)[0]
    return results


async def _wait_reserved(cluster: Cluster, decode_index: int = 0) -> None:
    """Until decode `decode_index` holds a reservation: routing and reserve are actor calls, each bounded
    by call_timeout_s."""
    deadline_s = time.monotonic() + 2 * call_bound_s(cluster)
    while (await cluster.decode_actors[decode_index].load.remote()).num_reserved == 0:
        assert time.monotonic() < deadline_s, "the request never reached decode"
        await asyncio.sleep(0.002)


async def _generate(cluster: Cluster, request_id: str, ids: list[int], params=GREEDY, with_text=False):
    tokens, last, text = [], None, ""
    async for delta in cluster.generate(request_id, ids, params):
        tokens += delta.new_token_ids
        text += delta.new_text
        last = delta
    return (tokens, last, text) if with_text else (tokens, last)


def stopped_stop(outputs) -> tuple[str]:
    """The stop string `single_engine_outputs` used for its stopped request."""
    stop = outputs[1][0].text[5:8]
    assert len(stop) == 3, outputs[1][0].text
    return (stop,)


def _assert_no_blocks_held(cluster: Cluster) -> None:
    assert_nothing_held(cluster)


@pytest.mark.parametrize(
    ("transport", "layerwise", "k", "tls"),
    [
        ("grpc", True, 1, False),
        ("grpc", False, 0, True),
        ("torch_distributed", True, 0, False),
        ("auto", True, 1, False),  # the default pair (auto: shm on this one node)
        ("shm", False, 0, False),
    ],  # each transport, layerwise and whole, k = 0 and 1, TLS: a deployment each, so not every product
)
def test_greedy_and_acceptance_match_single_engine(
    ray_session, single_engine_outputs, tmp_path, transport, layerwise, k, tls
) -> None:
    """P -> D over each transport (`auto` resolves to shm on this one node), layerwise or not, with and
    without MTP, and over gRPC with mutual TLS:
    the greedy tokens equal one engine's token for token, and with MTP the drafts proposed/accepted are
    the same counts (the MTP KV and first drafts travel with the handoff). The text decode sends equals the
    engine's, also for a request its stop string ends (finish_reason "stop", the edge detokenizes nothing).
    Every handoff presents the secret decode's reservation created. No KV block is held afterwards.
    On the default pair (auto = shm, layerwise, k=1, no TLS), the same deployment then serves 32 requests at
    once (`_assert_32_concurrent_requests_complete_without_leaks`; it had a deploy of its own)."""
    tls_config = None
    if tls:
        files = write_test_certificates(tmp_path)
        if files is None:
            pytest.skip("the openssl CLI is not installed")
        tls_config = KVTLSConfig(**files, server_name="pdcluster-kv")
    topo = _topology(transport, layerwise, k, tls_config)
    cluster = Cluster.deploy(topo)
    try:
        assert isinstance(cluster, ServingBackend)
        assert topo.kv_transport == ("shm" if transport == "auto" else transport)

        async def run():
            results = [
                await _generate(cluster, f"r{i}", cluster.tokenizer.encode(p), with_text=True)
                for i, p in enumerate(PROMPTS)
            ]
            return results

        results = asyncio.run(run())
        for (tokens, last, text), expected in zip(results, single_engine_outputs[k], strict=True):
            assert tokens == expected.token_ids
            assert text == expected.text
            assert last.finished and last.finish_reason == "length"
            assert last.num_draft_tokens == expected.num_draft_tokens
            assert last.num_accepted_tokens == expected.num_accepted_tokens
            for phase in PHASE_NAMES:  # route, reserve, ..., admitted, first decode step, total
                if phase != "prefill_cpu_wait_s" or run_delay_s() is not None:  # (Linux only)
                    assert phase in last.phases, (phase, last.phases)
            if run_delay_s() is not None:  # Linux: of prefill_s, the prefill engine thread's wait for a CPU
                waited_s, prefill_s = last.phases["prefill_cpu_wait_s"], last.phases["prefill_s"]
                assert 0.0 <= waited_s <= last.phases["queue_s"] + prefill_s, last.phases
        stopped = single_engine_outputs["stop", k]
        assert stopped.finish_reason == "stop" and len(stopped.text) < len(single_engine_outputs[k][0].text)
        params = dataclasses.replace(GREEDY, stop=stopped_stop(single_engine_outputs))
        _, last, text = asyncio.run(
            _generate(cluster, "stop", cluster.tokenizer.encode(PROMPTS[0]), params, True)
        )
        assert (text, last.finish_reason) == (stopped.text, "stop")
        _assert_no_blocks_held(cluster)
        # shm (auto on one node) writes every handoff in place into decode's shared cache; others never
        decode = cluster.decode_actors[0]
        in_place = ray_session.get(decode.kv_in_place_stats.remote(), timeout=cluster.call_timeout_s)
        expected_in_place = len(PROMPTS) + 1 if topo.kv_transport == "shm" else 0
        assert in_place == {"granted": expected_in_place, "fenced": 0}, in_place
        if (transport, layerwise, k, tls) == ("auto", True, 1, False):  # the default pair: one deploy
            _assert_32_concurrent_requests_complete_without_leaks(cluster)
    finally:
        cluster.shutdown()


def _assert_32_concurrent_requests_complete_without_leaks(cluster: Cluster) -> None:
    """32 requests at once (more than fit one step's batch of handoffs) all finish with their max_tokens,
    and afterwards no KV block, reservation or open handoff is left on either pool."""
    prompts = [cluster.tokenizer.encode(f"def f{i}(x):\n    return x * {i} +") for i in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + i % 8, ignore_eos=True) for i in range(32)]

    async def run():
        return await asyncio.gather(
            *[
                _generate(cluster, f"c{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
        )

    results = asyncio.run(asyncio.wait_for(run(), request_bound_s(cluster)))
    for (tokens, last), sp in zip(results, params, strict=True):
        assert len(tokens) == sp.max_tokens and last.finished
    _assert_no_blocks_held(cluster)


def test_prefill_killed_mid_transfer_is_redispatched(ray_session, single_engine_outputs) -> None:
    """ray.kill of the prefill actor while decode holds the request's reservation: the request is
    re-dispatched to the other prefill instance and completes with the right tokens, the dead instance is
    taken out of routing, decode's reservation for the failed attempt is released, nothing hangs."""
    topo = _topology("grpc", True, 1, num_instances=2)
    topo = dataclasses.replace(topo, router=dataclasses.replace(topo.router, policy="round_robin"))
    cluster = Cluster.deploy(topo)
    try:
        long_prompt = cluster.tokenizer.encode(PROMPTS[0] * 60)[:900]

        async def run():
            task = asyncio.ensure_future(
                _generate(cluster, "victim", long_prompt, SamplingParams(temperature=0.0, max_tokens=4))
            )
            await _wait_reserved(cluster)
            ray_session.kill(cluster.prefill_actors[0])  # round robin: request 0 went to prefill-0
            return await asyncio.wait_for(task, request_bound_s(cluster))

        tokens, last = asyncio.run(run())
        assert last.finished and len(tokens) == 4
        single = LLM(bundled_checkpoint_dir(), num_kv_blocks=128)
        assert (
            tokens
            == single.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids
        )
        assert cluster.registry.routable("prefill") == [False, True]
        _assert_no_blocks_held(cluster)
    finally:
        cluster.shutdown()


def test_the_first_token_streams_from_prefill_and_a_failed_handoff_continues_after_it(
    ray_session, single_engine_outputs
) -> None:
    """The first token reaches the client from the prefill call's reply, before decode admits the request
    (decode's admission is held back until the client has it). Decode's admission then fails (an injected
    fault): the request is re-dispatched to the other prefill instance, which hands decode that token as
    the first instead of its own, and the client's tokens and text equal one engine's, none twice.
    Nothing is held afterwards."""
    topo = _topology("grpc", True, 1, num_instances=2)
    cluster = Cluster.deploy(topo)
    try:
        decode = cluster.decode_actors[0]
        # held until released below, at most one call bound (then the test fails: no early token came)
        ray_session.get(decode.inject_delay.remote("before_admit", call_bound_s(cluster)))
        ray_session.get(decode.inject_fault.remote("admit"))
        prompt = cluster.tokenizer.encode(PROMPTS[1])

        async def run():
            deltas = []
            async for delta in cluster.generate("early", prompt, GREEDY):
                if not deltas:
                    await decode.release_delays.remote()
                deltas.append(delta)
            return deltas

        deltas = asyncio.run(asyncio.wait_for(run(), request_bound_s(cluster)))
        first, last = deltas[0], deltas[-1]
        # from attempt 1's prefill reply: decode had not received / admitted it
        assert len(first.new_token_ids) == 1 and "kv_transfer_s" not in first.phases, first
        assert "queue_s" in first.phases  # (prefill_s comes with the finished result, if it came early)
        assert {"prefill_s", "last_layer_sent_s"} <= set(last.phases), last.phases
        assert first.ranks["prefill"] != last.ranks["prefill"]  # re-dispatched to the other prefill
        expected = single_engine_outputs[1][1]
        assert [t for d in deltas for t in d.new_token_ids] == expected.token_ids
        assert "".join(d.new_text for d in deltas) == expected.text
        assert last.finished and last.finish_reason == "length"
        assert ray_session.get(decode.load.remote()).num_engine_errors == 1
        _assert_no_blocks_held(cluster)
    finally:
        cluster.shutdown()


def pdcluster_shm_entries() -> set[str]:
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if "pdcluster" in p.name} if root.is_dir() else set()


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_only_prefill_killed_fails_fast_with_clear_error(ray_session, transport) -> None:
    """With no other prefill instance, killing the only one mid-request ends the stream with
    BackendUnavailable naming the handoff failure (no hang), and decode holds no block afterwards. Over
    shm the handoff was written in place into decode's shared cache: its blocks are freed once the dead
    sender's connection ends (the fence), no segment stays mapped and nothing appears in /dev/shm."""
    shm_before = pdcluster_shm_entries()
    cluster = Cluster.deploy(_topology(transport, True, 1))
    try:
        long_prompt = cluster.tokenizer.encode(PROMPTS[1] * 40)[:900]

        async def run():
            task = asyncio.ensure_future(_generate(cluster, "victim", long_prompt))
            await _wait_reserved(cluster)
            ray_session.kill(cluster.prefill_actors[0])
            return await asyncio.wait_for(task, request_bound_s(cluster))

        with pytest.raises(BackendUnavailable, match="handoff failed|no live prefill"):
            asyncio.run(run())
        _assert_no_blocks_held(cluster)
        decode = cluster.decode_actors[0]
        deadline_s = time.monotonic() + call_bound_s(cluster)
        while ray_session.get(decode.num_kv_segments.remote(), timeout=cluster.call_timeout_s):
            assert time.monotonic() < deadline_s, "decode still maps the dead prefill's segments"
            time.sleep(0.05)
        if transport == "shm":  # in place if prefill began before it died (it may not have): no fence left
            stats = ray_session.get(decode.kv_in_place_stats.remote(), timeout=cluster.call_timeout_s)
            assert stats["fenced"] == 0, stats
        assert pdcluster_shm_entries() == shm_before
    finally:
        cluster.shutdown()
