"""End to end on a real local Ray cluster with the bundled tiny model (each test says what it proves): each
transport against one engine, concurrency, faults on the engine threads, a killed prefill.

One deployment per transport configuration (`pair`, module-scoped, parametrized indirectly): every test of
a configuration runs on its deployment, and the test that kills the prefill instance runs last on it
(pytest runs a module-scoped parameter's tests together, in file order)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import ray

from pdcluster.config import KVTLSConfig, load_topology
from pdcluster.driver.backend import PHASE_NAMES, BackendUnavailable, ServingBackend
from pdcluster.driver.cluster import Cluster
from pdcluster.driver.messages import DecodeNodeLoad, PrefillNodeLoad
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.workers.thread_clock import run_delay_s
from tests.cluster.conftest import assert_nothing_held, call_bound_s, deployed_with_loop, request_bound_s
from tests.faults import FAULT_WORKERS
from tests.kvtransfer.conftest import write_test_certificates

pytestmark = pytest.mark.slow

PROMPTS = [
    "def add(a, b):\n    return",
    'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the arguments and',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):\n    if i % 2 == 0:\n        print(",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _topology(transport="grpc", layerwise=True, k=1, tls=None, timeout_s=20, decode_seqs=None, **pools):
    topo = load_topology("clusters/local.yaml")
    topo = dataclasses.replace(
        topo,
        kv_transfer=dataclasses.replace(
            topo.kv_transfer, transport=transport, layerwise=layerwise, timeout_s=timeout_s, tls=tls
        ),
        decode=dataclasses.replace(  # eager: only test_cluster_compiled.py compiles (tests/conftest.py)
            topo.decode,
            num_speculative_tokens=k,
            kv_cache_memory_bytes=16 << 20,
            compile=False,
            max_num_seqs=decode_seqs or topo.decode.max_num_seqs,
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


DECODE_MAX_NUM_SEQS = 4  # of the "grpc" pair: the fault tests send more handoffs than this at once
# transport, layerwise, k, TLS: each transport, layerwise and whole, k = 0 and 1, TLS; not every product
PAIRS = {
    "grpc": ("grpc", True, 1, False),  # also the fault tests' (kv timeout 10 s, DECODE_MAX_NUM_SEQS)
    "grpc-whole-tls": ("grpc", False, 0, True),
    "torch_distributed": ("torch_distributed", True, 0, False),
    "auto": ("auto", True, 1, False),  # the default pair (auto: shm on this one node)
    "shm-whole": ("shm", False, 0, False),
}


@pytest.fixture(scope="module")
def pair(request, ray_session, tmp_path_factory):
    """The deployment of `PAIRS[request.param]`, with `k` and `shm_before` (/dev/shm's pdcluster entries
    before it was deployed) set on it."""
    transport, layerwise, k, tls = PAIRS[request.param]
    tls_config = None
    if tls:
        files = write_test_certificates(tmp_path_factory.mktemp("tls"))
        if files is None:
            pytest.skip("the openssl CLI is not installed")
        tls_config = KVTLSConfig(**files, server_name="pdcluster-kv")
    faults = request.param == "grpc"
    topo = _topology(transport, layerwise, k, tls_config, *((10, DECODE_MAX_NUM_SEQS) if faults else ()))
    assert topo.kv_transport == ("shm" if transport == "auto" else transport)
    shm_before = pdcluster_shm_entries()
    with deployed_with_loop(topo, worker_classes=FAULT_WORKERS) as cluster:
        cluster.k, cluster.shm_before = k, shm_before
        yield cluster


def _run(cluster: Cluster, coro):
    return cluster.test_loop.run_until_complete(coro)


@pytest.mark.parametrize("pair", list(PAIRS), indirect=True)
def test_greedy_and_acceptance_match_single_engine(ray_session, single_engine_outputs, pair) -> None:
    """P -> D over each transport (`auto` resolves to shm on this one node), layerwise or not, with and
    without MTP, and over gRPC with mutual TLS:
    the greedy tokens equal one engine's token for token, and with MTP the drafts proposed/accepted are
    the same counts (the MTP KV and first drafts travel with the handoff). The text decode sends equals the
    engine's, also for a request its stop string ends (finish_reason "stop", the edge detokenizes nothing).
    Every handoff presents the secret decode's reservation created. No KV block is held afterwards."""
    cluster, k = pair, pair.k
    assert isinstance(cluster, ServingBackend)

    async def run():
        return [
            await _generate(cluster, f"r{i}", cluster.tokenizer.encode(p), with_text=True)
            for i, p in enumerate(PROMPTS)
        ]

    results = _run(cluster, run())
    for (tokens, last, text), expected in zip(results, single_engine_outputs[k], strict=True):
        assert tokens == expected.token_ids
        assert text == expected.text
        assert last.finished and last.finish_reason == "length"
        assert last.drafts.num_draft_tokens == expected.drafts.num_draft_tokens
        assert last.drafts.num_accepted_tokens == expected.drafts.num_accepted_tokens
        for phase in PHASE_NAMES:  # route, reserve, ..., admitted, first decode step, total
            if phase != "prefill_cpu_wait_s" or run_delay_s() is not None:  # (Linux only)
                assert phase in last.phases, (phase, last.phases)
        if run_delay_s() is not None:  # Linux: of prefill_s, the prefill engine thread's wait for a CPU
            waited_s, prefill_s = last.phases["prefill_cpu_wait_s"], last.phases["prefill_s"]
            assert 0.0 <= waited_s <= last.phases["queue_s"] + prefill_s, last.phases
    stopped = single_engine_outputs["stop", k]
    assert stopped.finish_reason == "stop" and len(stopped.text) < len(single_engine_outputs[k][0].text)
    params = dataclasses.replace(GREEDY, stop=stopped_stop(single_engine_outputs))
    _, last, text = _run(
        cluster, _generate(cluster, "stop", cluster.tokenizer.encode(PROMPTS[0]), params, True)
    )
    assert (text, last.finish_reason) == (stopped.text, "stop")
    _assert_no_blocks_held(cluster)
    # shm (auto on one node) writes every handoff in place into decode's shared cache; others never
    decode = cluster.decode_actors[0]
    in_place = ray_session.get(decode.kv_in_place_stats.remote(), timeout=cluster.call_timeout_s)
    expected_in_place = len(PROMPTS) + 1 if cluster.topology.kv_transport == "shm" else 0
    assert in_place == {"granted": expected_in_place, "fenced": 0}, in_place


@pytest.mark.parametrize("pair", ["auto"], indirect=True)
def test_32_concurrent_requests_complete_without_leaks(pair) -> None:
    """32 requests at once (more than fit one step's batch of handoffs) all finish with their max_tokens,
    and afterwards no KV block, reservation or open handoff is left on either pool."""
    cluster = pair
    prompts = [cluster.tokenizer.encode(f"def f{i}(x):\n    return x * {i} +") for i in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + i % 8, ignore_eos=True) for i in range(32)]

    async def run():
        return await asyncio.gather(
            *[
                _generate(cluster, f"c{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
        )

    results = _run(cluster, asyncio.wait_for(run(), request_bound_s(cluster)))
    for (tokens, last), sp in zip(results, params, strict=True):
        assert len(tokens) == sp.max_tokens and last.finished
    _assert_no_blocks_held(cluster)


@pytest.mark.parametrize("pair", ["grpc"], indirect=True)
def test_prefill_overlapped_with_the_reservation_or_after_it_gives_the_same_tokens(pair, monkeypatch) -> None:
    """The prefill call sent before decode's reservation (awaiting its bind) and, past
    MAX_EARLY_PREFILL_CALLS, after it (bound): the same greedy tokens, concurrent requests included; the
    load board counts no prefill work in flight afterwards and nothing stays held. After the first
    requests the board holds a snapshot of every decode rank (so routing needs no `load` call)."""
    import pdcluster.driver.routing as routing
    from pdcluster.driver.router import RankRef

    cluster = pair
    prompt = cluster.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n")

    async def batch(tag: str) -> list[list[int]]:
        done = await asyncio.gather(*[_generate(cluster, f"{tag}{i}", prompt) for i in range(3)])
        return [tokens for tokens, _ in done]

    overlapped = _run(cluster, batch("early"))
    assert cluster.dispatcher._loads.missing_decodes([0]) == []
    monkeypatch.setattr(routing, "MAX_EARLY_PREFILL_CALLS", 0)
    sequential = _run(cluster, batch("late"))
    assert len(overlapped[0]) == 16 and overlapped == sequential == [overlapped[0]] * 3
    assert cluster.dispatcher._loads.prefill_calls(RankRef(0, 0)) == 0
    assert cluster.dispatcher._loads.prefill_queued_tokens(RankRef(0, 0)) == 0
    _assert_no_blocks_held(cluster)


# ---- faults on the "grpc" pair: requests that finish at admission, more handoffs than decode's seats, and
# exceptions on the engine threads (`inject_fault` of the deployed tests.faults workers). Every
# request runs under a timeout: the failure these tests guard against is a hang.
FAULT_PROMPT = "def add(a, b):\n    return"


def _complete(cluster: Cluster, request_id: str, params: SamplingParams):
    """(tokens, last delta) of FAULT_PROMPT, or the stream's exception; TimeoutError means it hung."""
    ids = cluster.tokenizer.encode(FAULT_PROMPT)
    return _run(
        cluster, asyncio.wait_for(_generate(cluster, request_id, ids, params), request_bound_s(cluster))
    )


def _healthy_request_completes(cluster: Cluster, request_id: str) -> None:
    tokens, last = _complete(
        cluster, request_id, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    assert len(tokens) == 6 and last.finished and last.finish_reason == "length"
    _assert_no_blocks_held(cluster)


def _load(cluster: Cluster, actor) -> PrefillNodeLoad | DecodeNodeLoad:
    return ray.get(actor.load.remote(), timeout=cluster.call_timeout_s)  # what the cluster allows one call


@pytest.mark.parametrize("pair", ["grpc"], indirect=True)
def test_request_finished_at_admission_completes_on_an_idle_decode(pair) -> None:
    """max_tokens=1 (and a first token that is a stop token) finishes the request when decode admits
    it; with nothing else running, its final delta must still come (it hung: nothing stepped)."""
    tokens, last = _complete(pair, "one", SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert len(tokens) == 1
    assert last.finished and last.finish_reason == "length"
    assert "kv_transfer_s" in last.phases and "first_decode_step_s" in last.phases
    _assert_no_blocks_held(pair)
    # The same first token as a stop token (as EOS would): finished at admission, reason "stop".
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(tokens[0],))
    stopped, last = _complete(pair, "stop-first", params)
    assert stopped == tokens and last.finished and last.finish_reason == "stop"
    _assert_no_blocks_held(pair)


@pytest.mark.parametrize("pair", ["grpc"], indirect=True)
def test_more_concurrent_streams_than_decode_max_num_seqs_all_complete(pair) -> None:
    """With more handoffs in flight than decode's max_num_seqs, the excess waits for a seat on decode;
    every stream completes (admissions overfilling the batch failed every request's step)."""
    num_requests = 3 * DECODE_MAX_NUM_SEQS
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [pair.tokenizer.encode(f"{FAULT_PROMPT} {i}") for i in range(num_requests)]

    async def run_all():
        return await asyncio.gather(
            *(_generate(pair, f"concurrent-{i}", ids[i], params) for i in range(num_requests))
        )

    results = _run(pair, asyncio.wait_for(run_all(), request_bound_s(pair)))
    assert [(len(tokens), last.finish_reason) for tokens, last in results] == [(12, "length")] * num_requests
    _assert_no_blocks_held(pair)


@pytest.mark.parametrize("pair", ["grpc"], indirect=True)
@pytest.mark.parametrize(
    ("role", "where"),
    [("decode", w) for w in ("admit", "delta", "loop")]
    + [("prefill", w) for w in ("start", "step", "complete")],
)
def test_engine_thread_exception_fails_the_request_and_the_loop_survives(pair, role, where) -> None:
    """An exception on decode's engine thread (admitting a handoff, turning step outputs into deltas, or the
    loop itself) or prefill's (starting, stepping or completing a prefill) becomes an error for that
    request: the stream raises BackendUnavailable naming it, or the cluster re-dispatches it and it
    completes. Blocks are freed (a failed prefill's handoff is aborted, so decode frees its reservation at
    once), the error is counted in load(), and the same thread serves the next request (it used to die:
    a hang). With one prefill the client hears the attempt's cause, and no Ray internals."""
    actor = (pair.decode_actors if role == "decode" else pair.prefill_actors)[0]
    errors_before = _load(pair, actor).num_engine_errors
    ray.get(actor.inject_fault.remote(where), timeout=pair.call_timeout_s)
    request_id = f"{role}-fault-{where}"
    try:
        tokens, last = _complete(
            pair, request_id, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )
    except BackendUnavailable as e:
        assert request_id in str(e)  # failed fast, no hang
        if role == "prefill":
            assert f"injected fault at {where}" in str(e), e
            assert "pid=" not in str(e) and "actor_id" not in str(e), e
    else:  # an error before the first token: re-dispatched, and the retry is served
        assert len(tokens) == 4 and last.finished
    load = _load(pair, actor)
    assert load.engine_thread_alive and load.num_engine_errors > errors_before
    _assert_no_blocks_held(pair)
    _healthy_request_completes(pair, f"after-{role}-{where}")


def pdcluster_shm_entries() -> set[str]:
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if "pdcluster" in p.name} if root.is_dir() else set()


@pytest.mark.parametrize("pair", ["grpc", "auto"], indirect=True)  # last on its deployment: it kills prefill
def test_only_prefill_killed_fails_fast_with_clear_error(ray_session, pair) -> None:
    """With no other prefill instance, killing the only one mid-request ends the stream with
    BackendUnavailable naming the handoff failure (no hang), and decode holds no block afterwards. Over
    shm the handoff was written in place into decode's shared cache: its blocks are freed once the dead
    sender's connection ends (the fence), no segment stays mapped and nothing new appears in /dev/shm."""
    cluster = pair
    long_prompt = cluster.tokenizer.encode(PROMPTS[1] * 40)[:900]

    async def run():
        task = asyncio.ensure_future(_generate(cluster, "victim", long_prompt))
        await _wait_reserved(cluster)
        ray_session.kill(cluster.prefill_actors[0])
        return await asyncio.wait_for(task, request_bound_s(cluster))

    with pytest.raises(BackendUnavailable, match="handoff failed|no live prefill"):
        _run(cluster, run())
    _assert_no_blocks_held(cluster)
    decode = cluster.decode_actors[0]
    deadline_s = time.monotonic() + call_bound_s(cluster)
    while ray_session.get(decode.num_kv_segments.remote(), timeout=cluster.call_timeout_s):
        assert time.monotonic() < deadline_s, "decode still maps the dead prefill's segments"
        time.sleep(0.05)
    if cluster.topology.kv_transport == "shm":  # in place if prefill began before it died: no fence left
        stats = ray_session.get(decode.kv_in_place_stats.remote(), timeout=cluster.call_timeout_s)
        assert stats["fenced"] == 0, stats
    assert pdcluster_shm_entries() == cluster.shm_before
