"""The OpenAI HTTP edge over a deployed Cluster on a local Ray (what `pdcluster deploy` serves): one
deployed pair (`served`) for the abort, structured-output, tool-call and logprobs tests."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import httpx
import openai
import pytest

from pdcluster.config import DEFAULT_TOPOLOGY_PATH, load_topology
from pdcluster.driver.cluster import Cluster
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.entrypoints.openai.app import build_app
from pdcluster.entrypoints.openai.server import ServerThread
from pdcluster.models import bundled_checkpoint_dir
from tests.cluster.conftest import call_bound_s, request_bound_s
from tests.conftest import eager_topology_file
from tests.faults import FAULT_WORKERS
from tests.openai_checks import chat_logprobs_whole_and_streamed

pytestmark = pytest.mark.slow

ABORTED = 'pdcluster_requests_total{finish_reason="abort"}'


def _topology():
    topo = load_topology("clusters/local.yaml")
    return dataclasses.replace(
        topo,
        # timeout_s 6 -> call_timeout_s 3 s: the abort (one actor call) must land well before the 900 asked
        # tokens could be decoded (>= 5 s at the ~6 ms TPOT of an idle machine, longer under load).
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=6),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
        decode=dataclasses.replace(topo.decode, kv_cache_memory_bytes=16 << 20, compile=False),  # eager
    )


def _is_idle(leaks: dict[str, dict]) -> bool:
    prefill, decode = leaks["prefill-0"], leaks["decode-0"]
    return (
        prefill["num_used_blocks"] == 0
        and prefill["num_active"] == 0
        and not prefill["pending_handoffs"]
        and decode["num_used_blocks"] == 0
        and decode["num_reserved"] == 0
        and decode["num_unfinished"] == 0
        and not decode["pending_handoffs"]
    )


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_load_test_in_small_against_the_cluster(ray_session, capsys, tmp_path) -> None:
    """`make load-test` in small: `bench.load_streams` deploys clusters/local.yaml (its eager copy,
    `tests.conftest.eager_topology_file`) behind the edge with max_concurrent_requests 8 and a separate
    client process opens 50 streams at once. Each completes or is refused with 429 + Retry-After before its
    stream starts, none is killed mid-stream, and the cluster holds nothing afterwards. (First in the
    module: it deploys its own cluster, before `served` exists.)"""
    from bench import load_streams

    code = load_streams.main(
        [
            "--cluster",
            str(eager_topology_file(DEFAULT_TOPOLOGY_PATH, tmp_path)),
            "--num-streams",
            "50",
            "--max-tokens",
            "8",
            "--max-concurrent-requests",
            "8",
            "--deadline-s",
            "120",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    results = report["results"]
    assert code == 0 and results["clean"], report
    assert results["killed_mid_stream"] == 0 and results["completed"] + results["refused"] == 50, results
    assert results["completed"] >= 8 and set(results["refusal_statuses"]) <= {"429", "503"}, results
    assert report["config"]["max_concurrent_requests"] == 8 and report["cluster_idle_after_run"], report


@pytest.fixture(scope="module")
def served(ray_session):
    """One deployed pair behind one edge for the rest of the module (each test leaves it idle and healthy,
    and counts its own aborts as a difference)."""
    cluster = Cluster.deploy(_topology(), worker_classes=FAULT_WORKERS)
    try:
        with ServerThread(build_app(cluster)) as server:
            yield cluster, server
    finally:
        cluster.shutdown()


def test_client_disconnect_mid_stream_aborts_on_both_pools(served) -> None:
    """A streamed completion (900 tokens asked) whose client closes the connection after the first chunk,
    once decode runs it: the edge aborts it in the cluster, which releases it on decode (the running
    request and its blocks) and on prefill (job and handoff); within seconds, long before 900 tokens could
    be decoded, check_no_leaks reports nothing held on either pool, the edge counts one aborted request,
    and the pair still serves."""
    cluster, server = served
    assert _is_idle(leaks := cluster.check_no_leaks()), leaks
    with httpx.Client(base_url=server.url, timeout=request_bound_s(cluster)) as client:
        aborted_before = _metric(client.get("/metrics").text, ABORTED)
        body = {
            "prompt": "def add(a, b):\n    return",
            "max_tokens": 900,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            # The first token comes with the prefill call's reply, maybe before decode admitted the
            # request: wait until decode runs it (its handoff ends within the lease, event_timeout_s).
            deadline_s = time.monotonic() + cluster.event_timeout_s
            while (running := cluster.check_no_leaks()["decode-0"])["num_unfinished"] != 1:
                assert time.monotonic() < deadline_s, running
                time.sleep(0.02)
            assert running["num_used_blocks"] > 0, running
        # leaving the block closed the connection mid-stream

        closed_s = time.monotonic()
        while not _is_idle(leaks := cluster.check_no_leaks()):
            assert time.monotonic() - closed_s < call_bound_s(cluster), leaks  # one abort call
            time.sleep(0.05)
        assert not cluster.dispatcher._requests
        assert _metric(client.get("/metrics").text, ABORTED) == aborted_before + 1

        after = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4, "temperature": 0})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def _send_completion(server: ServerThread, body: dict) -> socket.socket:
    """A raw HTTP/1.1 client: the request sent, the socket returned unread (so nothing of the response has
    been received when the test closes it)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=5)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _assert_nothing_received(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        assert sock.recv(1) == b"", "the server closed the connection"
    sock.setblocking(True)


@pytest.mark.parametrize(
    ("where", "stream"),
    [("after_reserve", True), ("before_reserve", False)],
    ids=["reserved-then-client-gone-stream", "client-gone-then-reserved"],
)
def test_client_gone_before_first_byte_releases_decode_reservation(
    ray_session, served, where: str, stream: bool
) -> None:
    """Issue 12, finding 5: a client that closes its connection before the first byte of the response,
    while decode's `reserve` call is in flight, used to leave the reservation held until its lease ran out
    (kv_transfer.timeout_s, 6 s here): the edge cancelled the request inside `Cluster._dispatch`, which
    dropped the attempt without releasing it. Decode's reserve reply is delayed by 0.6 x call_timeout_s
    (decode stays in routing). after_reserve: the reservation is made, then the client goes; it is
    released within one call bound of the close. before_reserve: the client goes before decode reserves
    (the abort overtakes the reserve); it is released once the reserve call returns, within one call
    bound of the reserve. Both: the pair is idle and healthy, and serves the next request."""
    cluster, server = served
    assert _is_idle(leaks := cluster.check_no_leaks()), leaks
    with httpx.Client(base_url=server.url, timeout=request_bound_s(cluster)) as client:
        aborted_before = _metric(client.get("/metrics").text, ABORTED)
    delay_s = 0.6 * cluster.call_timeout_s
    # one delayed reserve (count=1): this test's request's; the next request's reserve is not delayed
    ray_session.get(cluster.decode_actors[0].inject_delay.remote(where, delay_s), timeout=30)
    body = {
        "prompt": "def add(a, b):\n    return",
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    sent_s = time.monotonic()
    sock = _send_completion(server, body)
    # the attempt exists (routing done) and its reserve call is in flight
    attempts = lambda: [r.attempt for r in list(cluster.dispatcher._requests.values())]  # noqa: E731
    while not any(a is not None and a.meta is None for a in attempts()):
        assert time.monotonic() - sent_s < delay_s, "the request did not reach reserve"
        time.sleep(0.01)
    if where == "after_reserve":
        while cluster.check_no_leaks()["decode-0"]["num_reserved"] != 1:
            assert time.monotonic() - sent_s < delay_s, "decode did not reserve"
            time.sleep(0.01)
    else:
        time.sleep(min(0.2, delay_s / 4))  # the reserve call has left the driver
    _assert_nothing_received(sock)
    sock.close()
    closed_s = time.monotonic()

    if where == "after_reserve":
        while not _is_idle(leaks := cluster.check_no_leaks()):
            assert time.monotonic() - closed_s < call_bound_s(cluster), leaks  # one abort call
            time.sleep(0.05)
    else:  # the reservation is made delay_s after the request reached decode, then released
        time.sleep(max(0.0, sent_s + delay_s + call_bound_s(cluster) - time.monotonic()))
        leaks = cluster.check_no_leaks()
        assert _is_idle(leaks), leaks
    assert not cluster.dispatcher._requests
    assert cluster.health()["decode-0"]["state"] == "healthy"
    with httpx.Client(base_url=server.url, timeout=request_bound_s(cluster)) as client:
        r = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert _metric(client.get("/metrics").text, ABORTED) == aborted_before + 1
    assert _is_idle(leaks := cluster.check_no_leaks()), leaks


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_openai_sdk_json_schema_and_tool_calls_through_the_cluster(served) -> None:
    """The official `openai` SDK against the disaggregated pair with MTP on (clusters/local.yaml): a
    json_schema answer parses and validates against the schema, a named tool call comes back as
    `tool_calls` whose arguments validate against the tool's parameters, each streamed and not, the
    streamed ones equal to the whole ones (greedy). Prefill samples the first token under the grammar,
    decode continues it and verifies MTP drafts under it. /tokenize and /detokenize round-trip."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    cluster, server = served
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", timeout=request_bound_s(cluster), max_retries=0
    )
    messages = [{"role": "user", "content": "Is Paris in France? Answer in JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    common = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 64}
    whole = client.chat.completions.create(**common, response_format=response_format)
    assert whole.choices[0].finish_reason == "stop", whole
    jsonschema.validate(json.loads(whole.choices[0].message.content), ANSWER_SCHEMA)
    chunks = list(client.chat.completions.create(**common, response_format=response_format, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert whole.pdcluster["num_draft_tokens"] > 0  # MTP drafts were verified under the grammar

    tools_common = {**common, "max_tokens": 160, "tools": [WEATHER_TOOL]}
    named = {"type": "function", "function": {"name": "get_weather"}}
    called = client.chat.completions.create(**tools_common, tool_choice=named)
    (call,) = called.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    assert called.choices[0].finish_reason == "tool_calls"
    streamed = list(client.chat.completions.create(**tools_common, tool_choice="required", stream=True))
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    # the header (id, name, arguments "") first, then argument fragments that join to the whole call's
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert {d.index for d in deltas} == {0} and len(deltas) > 2
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert streamed[-1].choices[0].finish_reason == "tool_calls"

    with httpx.Client(base_url=server.url, timeout=request_bound_s(cluster)) as http:
        tokens = http.post("/tokenize", json={"prompt": "def f(x):"}).json()
        assert (
            tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == cluster.max_model_len
        )
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "def f(x):"}
        bad = http.post("/v1/chat/completions", json={**common, "guided_regex": "(unclosed"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex", bad.text
    assert _is_idle(leaks := cluster.check_no_leaks()), leaks


# ---- logprobs and logit processors through the pair ---------------------------------------------------
# The first token's logprobs (computed on prefill, carried with the KV handoff) and the decode tokens'
# (accepted MTP drafts' included: the target model's) equal one engine's (MTP off) within TOLERANCE (other
# processes, thread counts and batch shapes: float32 sums in another order); penalties, min_tokens and
# logit_bias act on prefill's first token as on decode's; chat streams logprobs, and n=3 gives 3 choices.
PROMPT = "def merge_sorted(a, b):\n"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def client(served):
    cluster, server = served
    assert cluster.topology.decode.num_speculative_tokens >= 1  # MTP on
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=request_bound_s(cluster)
    )


@pytest.fixture(scope="module")
def engine() -> LLM:
    return LLM(bundled_checkpoint_dir())


def test_greedy_logprobs_and_penalties_equal_one_engine(client, engine):
    plain = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    penalised = dataclasses.replace(
        plain, presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.2, min_tokens=4
    )
    for params in (plain, penalised):
        expected = engine.generate([PROMPT], params)[0]
        got = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            logprobs=3,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            extra_body={
                "repetition_penalty": params.repetition_penalty,
                "min_tokens": params.min_tokens,
                "ignore_eos": True,
            },
        )
        choice = got.choices[0]
        assert choice.text == expected.text
        assert choice.logprobs.token_logprobs == pytest.approx(
            [t.logprob for t in expected.logprobs], abs=TOLERANCE
        )
        top = [max(alternatives.values()) for alternatives in choice.logprobs.top_logprobs]
        assert top == pytest.approx([t.top_logprobs[0] for t in expected.logprobs], abs=TOLERANCE)
    forced = engine.tokenizer.encode(" banana")[0]
    biased = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert biased.choices[0].text == engine.tokenizer.decode([forced] * 3)  # the first token is prefill's


def test_min_tokens_holds_back_eos_and_an_unfinishable_schema_ends_with_length(client, engine):
    """min_tokens through the pair: a logit bias makes EOS the argmax at every position; without min_tokens
    the answer is EOS alone, with min_tokens 4 EOS is held back on prefill's first token and decode's next
    three and ends the answer as its fifth, as on one engine. A json_schema answer cut by max_tokens before
    the JSON closes ends with finish_reason "length" (whole and streamed), its text not valid JSON."""
    eos = engine.tokenizer.eos_token_id
    common = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 12,
        "logit_bias": {str(eos): 100},
    }
    free = client.completions.create(**common)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens == 1, free
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=4, logit_bias={eos: 100})
    expected = engine.generate([PROMPT], params)[0]
    assert expected.token_ids[4:] == [eos] and eos not in expected.token_ids[:4]
    for stream in (False, True):
        held = client.completions.create(**common, extra_body={"min_tokens": 4}, stream=stream)
        if stream:
            chunks = [c for c in held if c.choices]
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = held.choices[0].text, held.choices[0].finish_reason
            assert held.usage.completion_tokens == len(expected.token_ids), held
        assert (text, finish) == (expected.text, "stop")

    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    messages = [{"role": "user", "content": "Is Paris in France? Answer in JSON."}]
    chat = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 5}
    whole = client.chat.completions.create(**chat, response_format=response_format)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 5, whole
    with pytest.raises(ValueError):
        json.loads(whole.choices[0].message.content)
    chunks = [c for c in client.chat.completions.create(**chat, response_format=response_format, stream=True)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )


def test_chat_streamed_logprobs_and_n(client):
    messages = [{"role": "user", "content": PROMPT}]
    chat_logprobs_whole_and_streamed(client, messages, TOLERANCE, max_tokens=8, top_logprobs=2)
    three = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=3, seed=1, logprobs=1)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == 4 or c.finish_reason == "stop" for c in three.choices)


def test_streamed_completion_logprobs_and_streamed_n(client, engine):
    """A streamed completion's logprobs and top_logprobs equal one engine's (greedy, MTP off); a streamed
    n=3 finishes each index once, each with its own logprobs, and include_usage counts every choice once."""
    expected = engine.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    )
    common = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 0,
        "stream": True,
        "extra_body": {"ignore_eos": True},
    }
    chunks = [c for c in client.completions.create(**common, max_tokens=10, logprobs=3) if c.choices]
    entries = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    token_logprobs = [v for lp in entries for v in lp.token_logprobs]
    tops = [top for lp in entries for top in lp.top_logprobs]
    assert "".join(c.choices[0].text for c in chunks) == expected[0].text
    assert token_logprobs == pytest.approx([t.logprob for t in expected[0].logprobs], abs=TOLERANCE)
    assert [sorted(top.values(), reverse=True)[:3] for top in tops] == [
        pytest.approx(t.top_logprobs[:3], abs=TOLERANCE) for t in expected[0].logprobs
    ]
    streamed = client.completions.create(
        **{**common, "temperature": 1.0},
        max_tokens=4,
        n=3,
        seed=1,
        logprobs=2,
        stream_options={"include_usage": True},
    )
    finished: dict[int, int] = {}
    num_logprobs: dict[int, int] = {}
    usage = None
    for chunk in streamed:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.logprobs:
                num_logprobs[choice.index] = num_logprobs.get(choice.index, 0) + len(choice.logprobs.tokens)
                assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
            if choice.finish_reason is not None:
                finished[choice.index] = finished.get(choice.index, 0) + 1
    assert finished == {0: 1, 1: 1, 2: 1} and num_logprobs == {0: 4, 1: 4, 2: 4}
    assert usage is not None and usage.completion_tokens == 12


def test_echo_prompt_logprobs_equal_one_engine(served, client, engine):
    """Prompt logprobs (echo) are scored on prefill (MTP on) and reach the client with the first token: equal
    to one engine's (MTP off) within TOLERANCE, for the whole answer, max_tokens 0 and lm-eval's batch."""
    ids = engine.tokenizer.encode(PROMPT * 2)
    expected = engine.generate([ids], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))[0]
    want = [None] + [t.logprob for t in expected.prompt_logprobs[1:]]
    got = client.completions.create(
        model="tiny", prompt=ids, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    lp = got.choices[0].logprobs
    assert got.choices[0].text == engine.tokenizer.decode(ids, skip_special_tokens=False) + expected.text
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1 : len(ids)] == pytest.approx(
        want[1:], abs=TOLERANCE
    )
    tops = [max(a.values()) for a in lp.top_logprobs[1 : len(ids)]]
    assert tops == pytest.approx([t.top_logprobs[0] for t in expected.prompt_logprobs[1:]], abs=TOLERANCE)
    with httpx.Client(base_url=served[1].url, timeout=request_bound_s(served[0])) as http:
        scored = {"prompt": [ids, ids[:5]], "max_tokens": 0, "echo": True, "logprobs": 1}
        answer = http.post("/v1/completions", json=scored).json()
    assert [len(c["logprobs"]["tokens"]) for c in answer["choices"]] == [len(ids), 5]
    for choice, n in zip(answer["choices"], (len(ids), 5), strict=True):
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(want[1:n], abs=TOLERANCE)
    assert answer["usage"]["completion_tokens"] == 0
