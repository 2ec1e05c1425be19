"""Dispatch faults of `Cluster`: the first token streams from prefill and a failed handoff continues after
it, abort ends a request (never re-dispatched), a killed prefill's request is re-dispatched, a dead decode
instance is taken out of routing (its requests fail fast, later ones complete elsewhere), deploy refuses
tensor-parallel attention, and the multi-node wiring helpers. The helpers are fast unit tests; the rest
runs on the conftest's local Ray with the bundled tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from pdcluster.config import load_topology
from pdcluster.driver.backend import BackendUnavailable
from pdcluster.driver.cluster import (
    Cluster,
    actor_resource_options,
    advertised_address,
    check_deployable_parallelism,
    is_loopback_topology,
)
from pdcluster.driver.messages import NodeReady
from pdcluster.driver.rank_actors import (
    ACTORS_READY_TIMEOUT_S,
    COMPILE_READY_TIMEOUT_S,
    load_summary,
    ready_timeout_s,
)
from pdcluster.engine.compiled_forward import CompileStats
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from tests.cluster.conftest import call_bound_s, deployed_with_loop, request_bound_s
from tests.cluster.test_cluster import (
    GREEDY,
    PROMPTS,
    _assert_no_blocks_held,
    _generate,
    _topology,
    _wait_reserved,
)
from tests.faults import FAULT_WORKERS

CLUSTERS = Path(__file__).resolve().parents[2] / "clusters"


# ---- pure logic (no Ray) ------------------------------------------------------------------------------
def test_deploy_refuses_tensor_parallel_attention_and_partial_ep_naming_the_key():
    """Multi-rank instances deploy (data-parallel attention; experts split over every rank, or replicated);
    tensor-parallel attention and experts split over part of an instance are refused before Ray, naming
    the key."""
    check_deployable_parallelism(load_topology(CLUSTERS / "cm384.yaml"))  # EP32 / EP288, TP1: runnable
    check_deployable_parallelism(load_topology(CLUSTERS / "local-1p2d.yaml"))
    gpu = load_topology(CLUSTERS / "gpu-2node.yaml")
    with pytest.raises(ValueError, match=r"prefill\.tensor_parallel_size: tensor-parallel attention") as e:
        check_deployable_parallelism(gpu)
    assert "(prefill: 8 devices, TP8, EP8)" in str(e.value) and "decode" not in str(e.value)
    assert "`pdcluster validate` checks such a file as a plan only" in str(e.value)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Cluster.deploy(gpu)  # refused before Ray is touched
    local = load_topology(CLUSTERS / "local.yaml")
    partial = dataclasses.replace(
        local,
        hardware=dataclasses.replace(local.hardware, devices_per_node=6),
        decode=dataclasses.replace(local.decode, devices_per_instance=4, expert_parallel_size=2),
    )
    with pytest.raises(ValueError, match=r"decode\.expert_parallel_size: 2 of 4 devices would split"):
        check_deployable_parallelism(partial)


def test_deploy_from_python_refuses_8_bit_weights_before_ray():
    """`model.weight_dtype: int8` is a planning assumption (the engine runs `model.dtype`): `Cluster.deploy`
    refuses it as `pdcluster deploy` does, naming the key, before Ray is touched."""
    local = load_topology(CLUSTERS / "local.yaml")
    int8 = dataclasses.replace(local, model=dataclasses.replace(local.model, weight_dtype="int8"))
    with pytest.raises(ValueError, match=r"^model\.weight_dtype: int8 is not the dtype the engine runs"):
        Cluster.deploy(int8)


def test_multi_node_wiring_helpers():
    assert actor_resource_options(None) == {}
    assert actor_resource_options("GPU") == {"num_gpus": 1}  # Ray refuses resources={"GPU": 1}
    assert actor_resource_options("NPU") == {"resources": {"NPU": 1}}
    assert advertised_address("0.0.0.0:5005", "10.0.0.7") == "10.0.0.7:5005"
    assert advertised_address("127.0.0.1:5005", "10.0.0.7") == "127.0.0.1:5005"
    assert advertised_address("[::]:5005", "fd00::7") == "[fd00::7]:5005"  # gRPC's form of an IPv6 host
    from pdcluster.kvtransfer.paired import PairedAddress

    paired = PairedAddress("node-a", "/tmp/kv.sock", "0.0.0.0:5005")
    assert paired.with_grpc_host("10.0.0.7").grpc == "10.0.0.7:5005"
    assert paired.with_grpc_host("fd00::7").grpc == "[fd00::7]:5005"
    assert paired.pick("node-a") == ("shm", "/tmp/kv.sock") and paired.pick("node-b") == (
        "grpc",
        "0.0.0.0:5005",
    )
    assert is_loopback_topology(load_topology(CLUSTERS / "local.yaml"))
    assert is_loopback_topology(load_topology(CLUSTERS / "local-1p2d.yaml"))
    assert not is_loopback_topology(load_topology(CLUSTERS / "gpu-2node.yaml"))


def test_deploy_log_and_ready_wait_say_what_compile_does():
    """Each rank's ready line names its load time and what `compile` did (compiled in how long, or why the
    rank runs eagerly); deploy waits COMPILE_READY_TIMEOUT_S longer for ranks that compile."""
    ready = NodeReady("decode-0", 1, 52.04, 64, compile=CompileStats(True, True, compile_s=49.96))
    assert load_summary(ready) == "loaded in 52.0 s, the decode forward compiled in 50.0 s"
    failed = CompileStats(
        True, False, compile_s=0.5, error="InductorError: CppCompileError: C++ compile error"
    )
    assert load_summary(dataclasses.replace(ready, load_s=3.0, compile=failed)) == (
        "loaded in 3.0 s; compile is on but the decode forward runs eagerly: "
        "InductorError: CppCompileError: C++ compile error"
    )
    off = dataclasses.replace(ready, name="prefill-0", load_s=2.0, compile=CompileStats(False, False))
    assert load_summary(off) == "weights loaded in 2.0 s"
    local = load_topology(CLUSTERS / "local.yaml")
    compiled = dataclasses.replace(local, decode=dataclasses.replace(local.decode, compile=True))
    assert ready_timeout_s(compiled) == ACTORS_READY_TIMEOUT_S + COMPILE_READY_TIMEOUT_S
    eager = dataclasses.replace(local, decode=dataclasses.replace(local.decode, compile=False))
    assert ready_timeout_s(eager) == ACTORS_READY_TIMEOUT_S


# ---- on Ray ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dead_decode_is_taken_out_of_routing_and_the_last_one_fails_fast(ray_session) -> None:
    """1P2D. ray.kill of the decode instance running a request: that request is re-dispatched to the other
    decode instance with its streamed tokens kept (`driver.recompute`) and completes with the tokens the
    same request gives there alone, its phases saying how many were recomputed; later requests complete;
    stats() reports only the live one. With the only decode killed: BackendUnavailable at once, from
    generate, from check_ready (/health answers 503) and from stats()."""
    topo = load_topology(CLUSTERS / "local-1p2d.yaml")
    topo = dataclasses.replace(
        topo,
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=10),
        decode=dataclasses.replace(topo.decode, kv_cache_memory_bytes=16 << 20, compile=False),  # eager
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
    )
    cluster = Cluster.deploy(topo, num_cpus=3)
    try:
        prompt = cluster.tokenizer.encode("class Stack:\n    def __init__(self):")
        long_run = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

        async def kill_mid_stream():
            stream = cluster.generate("victim", prompt, long_run)
            tokens = []
            async for delta in stream:
                tokens += delta.new_token_ids
                if len(tokens) >= 2:  # admitted and streaming
                    break
            victim = cluster.dispatcher._requests["victim"].attempt.decode_index
            ray_session.kill(cluster.decode_actors[victim])
            async for delta in stream:
                tokens += delta.new_token_ids
            again = [t async for d in cluster.generate("again", prompt, long_run) for t in d.new_token_ids]
            results = await asyncio.gather(*[_generate(cluster, f"after{i}", prompt) for i in range(6)])
            return victim, tokens, delta, again, results

        victim, tokens, last, again, results = asyncio.run(kill_mid_stream())
        survivor = 1 - victim
        assert last.finish_reason == "length" and tokens == again and len(tokens) == long_run.max_tokens
        assert 2 <= last.phases["recomputed_tokens"] < long_run.max_tokens, last.phases
        assert last.ranks["decode"] == f"decode-{survivor}"
        for tokens, last in results:
            assert last.finish_reason == "length" and len(tokens) == 16
        routable = cluster.registry.routable("decode")
        assert routable[victim] is False and routable[survivor] is True
        assert set(cluster.stats()["kv_blocks"]) == {f"decode-{survivor}"}
        _assert_no_blocks_held(cluster)

        ray_session.kill(cluster.decode_actors[survivor])

        async def none_left():
            started_s = time.monotonic()
            with pytest.raises(BackendUnavailable, match="no live decode instance|died or stopped"):
                await _generate(cluster, "doomed", prompt)
            return time.monotonic() - started_s

        assert asyncio.run(none_left()) < 2 * call_bound_s(cluster)
        with pytest.raises(BackendUnavailable, match="no live decode instance"):
            cluster.check_ready()  # /health
        with pytest.raises(BackendUnavailable, match="no live decode instance"):
            cluster.stats()
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def two_prefills(ray_session):
    """2P1D over gRPC, MTP on, round robin: a second prefill instance to re-dispatch to. Shared by the
    tests below in file order (after the 1P2D test above: both deployments do not fit Ray's 4 CPUs at
    once); the last one kills a prefill instance."""
    topo = _topology("grpc", True, 1, num_instances=2)
    topo = dataclasses.replace(
        topo,
        router=dataclasses.replace(topo.router, policy="round_robin"),
        # timeout_s 10 -> call_timeout_s 5 s: the abort test waits one call bound for a re-dispatch
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=10),
    )
    with deployed_with_loop(topo, worker_classes=FAULT_WORKERS) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def one_engine() -> LLM:
    return LLM(bundled_checkpoint_dir(), num_speculative_tokens=1, num_kv_blocks=128)


def _run(cluster: Cluster, coro):
    return cluster.test_loop.run_until_complete(coro)


@pytest.mark.slow
def test_the_first_token_streams_from_prefill_and_a_failed_handoff_continues_after_it(
    ray_session, two_prefills, one_engine
) -> None:
    """The first token reaches the client from the prefill call's reply, before decode admits the request
    (decode's admission is held back until the client has it). Decode's admission then fails (an injected
    fault): the request is re-dispatched to the other prefill instance, which hands decode that token as
    the first instead of its own, and the client's tokens and text equal one engine's, none twice.
    Nothing is held afterwards."""
    cluster = two_prefills
    decode = cluster.decode_actors[0]
    errors_before = ray_session.get(decode.load.remote()).num_engine_errors
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

    deltas = _run(cluster, asyncio.wait_for(run(), request_bound_s(cluster)))
    first, last = deltas[0], deltas[-1]
    # from attempt 1's prefill reply: decode had not received / admitted it
    assert len(first.new_token_ids) == 1 and "kv_transfer_s" not in first.phases, first
    assert "queue_s" in first.phases  # (prefill_s comes with the finished result, if it came early)
    assert {"prefill_s", "last_layer_sent_s"} <= set(last.phases), last.phases
    assert first.ranks["prefill"] != last.ranks["prefill"]  # re-dispatched to the other prefill
    expected = one_engine.generate([prompt], GREEDY)[0]
    assert [t for d in deltas for t in d.new_token_ids] == expected.token_ids
    assert "".join(d.new_text for d in deltas) == expected.text
    assert last.finished and last.finish_reason == "length"
    assert ray_session.get(decode.load.remote()).num_engine_errors == errors_before + 1
    _assert_no_blocks_held(cluster)


@pytest.mark.slow
def test_a_prefill_failing_after_its_first_token_is_redispatched_and_the_token_streams_once(
    ray_session, two_prefills, one_engine
) -> None:
    """The prefill's hand-over fails after its first token was sampled (an injected fault at "complete",
    after the call's first reply): the call's last reply raises, the request is re-dispatched to the other
    prefill instance (with the streamed token forced, `PrefillRequest.first_token_id`, when the first reply
    reached the client before the failure), and the client's tokens and text equal one engine's, none
    twice. Nothing is held afterwards."""
    cluster = two_prefills
    dispatcher = cluster.dispatcher
    start_prefill, forced = dispatcher._start_prefill, []

    def armed(attempt, prompt_token_ids, params, first_token_id=None):
        if attempt.handoff_id.endswith("@0"):  # the first attempt's prefill fails after its first reply
            ray_session.get(cluster.prefill_actors[attempt.prefill_index].inject_fault.remote("complete"))
        else:
            forced.append(first_token_id)
        start_prefill(attempt, prompt_token_ids, params, first_token_id)

    prompt = cluster.tokenizer.encode(PROMPTS[2])
    dispatcher._start_prefill = armed
    try:
        deltas = _run(cluster, asyncio.wait_for(_deltas(cluster, "late", prompt), request_bound_s(cluster)))
    finally:
        dispatcher._start_prefill = start_prefill
    expected = one_engine.generate([prompt], GREEDY)[0]
    assert [t for d in deltas for t in d.new_token_ids] == expected.token_ids
    assert "".join(d.new_text for d in deltas) == expected.text
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert len(forced) == 1 and forced[0] in (None, expected.token_ids[0])  # re-dispatched once
    assert deltas[0].ranks["prefill"] != deltas[-1].ranks["prefill"] or forced == [None]
    _assert_no_blocks_held(cluster)


async def _deltas(cluster: Cluster, request_id: str, prompt: list[int]) -> list:
    return [delta async for delta in cluster.generate(request_id, prompt, GREEDY)]


@pytest.mark.slow
def test_abort_during_handoff_ends_the_request_and_never_redispatches(two_prefills) -> None:
    """abort() while decode holds the reservation (prefill / transfer under way): the stream ends with an
    empty delta, finish_reason "abort", no second attempt is dispatched, nothing stays held, and the
    cluster serves the next request."""
    cluster = two_prefills
    attempts: list[int] = []
    dispatch = cluster.dispatcher._dispatch

    async def spy(request_id, attempt_index, *args):
        attempts.append(attempt_index)
        return await dispatch(request_id, attempt_index, *args)

    cluster.dispatcher._dispatch = spy
    long_prompt = cluster.tokenizer.encode("def add(a, b):\n    return" * 60)[:900]

    async def run():
        task = asyncio.ensure_future(
            _generate(cluster, "victim", long_prompt, SamplingParams(temperature=0.0, max_tokens=8))
        )
        await _wait_reserved(cluster)
        await cluster.abort("victim")
        tokens, last = await asyncio.wait_for(task, request_bound_s(cluster))
        # A re-dispatch, if any, would start right after the failed attempt's release: one call.
        await asyncio.sleep(call_bound_s(cluster))
        return tokens, last

    try:
        tokens, last = _run(cluster, run())
        assert last.finished and last.finish_reason == "abort"
        assert attempts == [0]
        assert cluster.registry.routable("prefill") == [True, True]
        _assert_no_blocks_held(cluster)
        tokens, last = _run(cluster, _generate(cluster, "next", long_prompt[:50]))
        assert last.finish_reason == "length" and len(tokens) == 16
        _assert_no_blocks_held(cluster)
    finally:
        cluster.dispatcher._dispatch = dispatch


@pytest.mark.slow
def test_prefill_killed_mid_transfer_is_redispatched(ray_session, two_prefills, one_engine) -> None:
    """ray.kill of the prefill actor while decode holds the request's reservation: the request is
    re-dispatched to the other prefill instance and completes with the right tokens, the dead instance is
    taken out of routing, decode's reservation for the failed attempt is released, nothing hangs.
    (Last on `two_prefills`: it leaves one prefill instance dead.)"""
    cluster = two_prefills
    long_prompt = cluster.tokenizer.encode(PROMPTS[0] * 60)[:900]
    params = SamplingParams(temperature=0.0, max_tokens=4)

    async def run():
        task = asyncio.ensure_future(_generate(cluster, "victim", long_prompt, params))
        await _wait_reserved(cluster)
        victim = cluster.dispatcher._requests["victim"].attempt.prefill_index
        ray_session.kill(cluster.prefill_actors[victim])
        return victim, await asyncio.wait_for(task, request_bound_s(cluster))

    victim, (tokens, last) = _run(cluster, run())
    assert last.finished and len(tokens) == 4
    assert tokens == one_engine.generate([long_prompt], params)[0].token_ids
    assert cluster.registry.routable("prefill") == [victim != 0, victim != 1]
    _assert_no_blocks_held(cluster)
