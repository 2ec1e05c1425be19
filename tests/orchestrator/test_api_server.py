"""The OpenAI-compatible edge over a LocalEngineBackend on the bundled tiny model, through a real uvicorn
server on 127.0.0.1 (a free port) and httpx. Fakes only inject faults (the 503 tests)."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx
import pytest

from pdcluster.config import SLOConfig
from pdcluster.driver.backend import BackendUnavailable, LocalEngineBackend, ServingBackend, StreamDelta
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.entrypoints.openai.app import build_app
from pdcluster.entrypoints.openai.chat_template import ChatTemplate
from pdcluster.entrypoints.openai.server import ServerThread
from pdcluster.models import bundled_checkpoint_dir

MAX_MODEL_LEN = 256
PROMPT = "def fibonacci(n):\n"
API_KEY = "sk-test"


@pytest.fixture(scope="module")
def reference() -> LLM:
    """The offline engine the server must agree with (the backends share its weights)."""
    return LLM(bundled_checkpoint_dir(), max_model_len=MAX_MODEL_LEN, num_kv_blocks=96)


@pytest.fixture(scope="module")
def backend(reference: LLM) -> Iterator[LocalEngineBackend]:
    engine = reference.replace_config().engine
    backend = LocalEngineBackend(engine.config, engine=engine)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def server(backend: LocalEngineBackend) -> Iterator[ServerThread]:
    with ServerThread(build_app(backend, slo=SLOConfig(ttft_ms=10_000, tpot_ms=1_000))) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse_events(lines: Iterator[str]) -> list[Any]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def wait_idle(backend: LocalEngineBackend, timeout_s: float = 10.0) -> None:
    """Wait until the engine has no request and holds no KV block, then check the allocator is empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = backend.stats()
        blocks = stats["kv_blocks"]["local"]
        idle = stats["num_waiting_requests"] == 0 and stats["num_running_requests"] == 0
        if idle and blocks["num_used_blocks"] == 0 and not backend.engine.has_unfinished_requests():
            break
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.02)
    backend.engine.scheduler.block_manager.check_no_leaks()


# ---- generation -----------------------------------------------------------------------------------------
def test_completion_equals_llm_generate_greedy(client: httpx.Client, reference: LLM) -> None:
    expected = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0]
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected.text
    assert body["choices"][0]["finish_reason"] == expected.finish_reason
    assert body["usage"] == {
        "prompt_tokens": len(expected.prompt_token_ids),
        "completion_tokens": len(expected.token_ids),
        "total_tokens": len(expected.prompt_token_ids) + len(expected.token_ids),
    }
    ext = body["pdcluster"]
    assert {"queue_s", "prefill_s", "kv_transfer_s", "first_decode_step_s", "total_s"} <= set(ext["phases"])
    assert ext["ttft_s"] > 0 and ext["tpot_s"] > 0 and ext["e2e_s"] >= ext["ttft_s"]
    assert ext["acceptance_rate"] is None  # no speculative decoding on this backend


def test_token_id_prompt_and_stop_string(client: httpx.Client, reference: LLM) -> None:
    ids = reference.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=40, stop=["\n"])
    expected = reference.generate([ids], params)[0]
    body = {"prompt": ids, "max_tokens": 40, "temperature": 0, "stop": "\n"}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected.text
    assert "\n" not in expected.text
    events = stream(client, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_concatenation_equals_non_streaming(client: httpx.Client, path: str) -> None:
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20, "temperature": 0}
    else:
        body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    whole = client.post(path, json=body).json()
    events = stream(client, path, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    if path.endswith("chat/completions"):
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == whole["choices"][0]["text"]
    assert len(chunks) > 2  # really streamed, token by token
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all("usage" not in c for c in chunks)  # only the include_usage chunk carries it: counted once
    assert "phases" in chunks[-1]["pdcluster"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_usage_sends_a_usage_only_last_chunk(client: httpx.Client, path: str) -> None:
    """Issue 11's temperature-1.0 "shortfall": `vllm bench serve` (no temperature sent: the default 1.0)
    reads `usage` only from a chunk with an empty `choices` list, else re-tokenizes the text, which at
    temperature 1.0 gives another count than the tokens generated. With `stream_options.include_usage`
    that chunk comes last, before [DONE], and counts every generated token."""
    max_tokens = 48
    common = {"max_tokens": max_tokens, "ignore_eos": True, "seed": 7}
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": PROMPT}], **common}
    else:
        body = {"prompt": PROMPT, **common}
    events = stream(client, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert last["choices"] == [] and last["id"] == chunks[0]["id"]
    assert last["usage"]["completion_tokens"] == max_tokens
    assert all(c["choices"] for c in chunks)  # only the last chunk lacks choices
    # counted as vLLM's benchmark client counts: usage from choice-less chunks only
    counted = [e["usage"]["completion_tokens"] for e in events[:-1] if not e["choices"] and e.get("usage")]
    assert counted == [max_tokens]
    plain = stream(client, path, body)  # without stream_options: no choice-less chunk
    assert all(e["choices"] for e in plain[:-1])


def test_chat_uses_the_checkpoint_template(client: httpx.Client, reference: LLM) -> None:
    messages = [{"role": "system", "content": "# utilities"}, {"role": "user", "content": "import os\n"}]
    prompt = ChatTemplate(reference.tokenizer).render(messages)
    assert prompt == "<|bos|># utilities<|User|>import os\n<|Assistant|>"
    expected = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


def test_models_and_health(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/health").json() == {"status": "ok"}


def test_health_says_starting_until_serve_hands_the_service_over(backend: LocalEngineBackend) -> None:
    """Listening but not yet handed to deploy's loop (`entrypoints.serve` sets `app.state.starting`):
    503, so that a probe's 200 means a SIGTERM takes deploy's drain path."""
    app = build_app(backend)
    app.state.starting = True
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is starting"
        app.state.starting = False
        assert c.get("/health").json() == {"status": "ok"}


# ---- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("{not json", "not valid JSON"),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens must be >= 1, got -3"),
        ({"prompt": "x", "max_tokens": 10**9}, f"max_model_len) of {MAX_MODEL_LEN} tokens"),
        ({"prompt": [5] * MAX_MODEL_LEN}, f"the prompt has {MAX_MODEL_LEN} tokens"),
        ({"prompt": [5] * 200, "max_tokens": 100}, "the prompt (200 tokens) plus max_tokens (100) is 300"),
        ({"prompt": "x", "n": 17}, "n must be in [1, 16], got 17"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of must be in [n, 16], got 2"),
        ({"prompt": "x", "best_of": 3, "stream": True}, "best_of > n cannot be streamed"),
        ({"prompt": "x", "logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias token ids must be in [0, "),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty must be a number in [-2, 2], got 3"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 5}, "min_tokens must be an int in [0, max_tokens]"),
        ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids token ids must be in [0, "),
        ({"prompt": "x", "suffix": "y"}, "suffix is not supported"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type must be text"),
        ({"prompt": "x", "guided_regex": "(a"}, "guided_regex: regex does not compile"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "one structured output at a time"),
        ({"prompt": "x", "temperature": -1}, "temperature must be"),
        ({"prompt": [10**6]}, "prompt token ids must be in"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"max_tokens": 4}, "prompt: Field required"),
        # Issue 12, finding 2: these passed the edge, then broke the engine step of every request batched
        # with them (503 for all, the poison request included).
        ({"prompt": "x", "seed": 2**70}, "seed must be in [0, 2**64)"),
        ({"prompt": "x", "top_p": 1e-300}, "top_p must be > 0 in float32"),
        ({"prompt": "x", "temperature": 1e-300}, "temperature must be 0 (greedy) or >= 1e-05"),
        ({"prompt": "x", "top_k": 2**64}, "top_k must be <= 2**63 - 1"),
        # Issue 12, finding 3: a lone surrogate (valid JSON, invalid Unicode) was a 500 TypeError from the
        # tokenizer ("TextInputSequence must be str").
        ({"prompt": "x = \ud800"}, "prompt: Value error, not valid Unicode: U+D800 at character 4"),
        ({"prompt": "x", "stop": ["\udc00"]}, "stop: Value error, not valid Unicode: U+DC00 at character 0"),
    ],
)
def test_bad_requests_get_400_with_openai_error_body(client: httpx.Client, body: Any, needle: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400


@pytest.mark.parametrize(
    ("path", "body", "headers", "message", "param"),
    [
        # mistakes a new user made, answered before with pydantic's union-by-union account
        (
            "/v1/completions",
            {"prompt": ["a", [1]]},
            {},
            "a list of prompts that are all text or all",
            "prompt",
        ),
        ("/v1/completions", {"prompt": [[1, 2], ["x"]]}, {}, "prompt: must be text, token ids, or", "prompt"),
        (  # curl -d without -H: a form's content type
            "/v1/completions",
            {"prompt": "x"},
            {"content-type": "application/x-www-form-urlencoded"},
            "sent with Content-Type: application/json (got Content-Type 'application/x-www-form-urlencoded')",
            None,
        ),
        ("/v1/completions", {"prompt": "x"}, None, "(got no Content-Type)", None),
        # JSON, but not an object: pydantic's words stay
        ("/v1/completions", [1], {}, "invalid request: Input should be a valid dictionary", None),
    ],
)
def test_common_mistakes_get_a_400_that_says_what_to_do(
    client: httpx.Client, path: str, body: Any, headers: dict | None, message: str, param: str | None
) -> None:
    if headers is None:  # no Content-Type at all
        request = client.build_request("POST", path, content=json.dumps(body))
        request.headers.pop("content-type", None)
    else:
        request = client.build_request("POST", path, content=json.dumps(body), headers=headers)
        request.headers.setdefault("content-type", "application/json")
    r = client.send(request)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_model_is_404_naming_the_served_one(client: httpx.Client, path: str) -> None:
    """As OpenAI's API and vLLM answer it: clients tell "no such model" from a malformed request."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    prompt = {"prompt": "x"} if path == "/v1/completions" else chat
    r = client.post(path, json={"model": "gpt-4", **prompt})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["message"].startswith("unknown model 'gpt-4'; this server serves ")
    assert error == {**error, "type": "invalid_request_error", "param": "model", "code": 404}


@pytest.mark.parametrize(
    ("path", "body", "needle", "param"),
    [
        # found by an attack pass: converted and served before (true as token id 1, "10" as 10)
        (
            "/v1/completions",
            {"prompt": [True, False]},
            "prompt.list[int].0: Input should be a valid integer",
            "prompt",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": "10"},
            "Input should be a valid integer",
            "max_tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 1e30},
            "Input should be a valid integer",
            "max_tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "temperature": "0"},
            "Input should be a valid number",
            "temperature",
        ),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "Input should be a valid boolean", "stream"),
        # the sampling values' own checks name their field in `param`
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature must be", "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p must be in (0, 1]", "top_p"),
        ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k must be an int >= 1", "top_k"),
        ("/v1/completions", {"prompt": "x", "seed": -1}, "seed must be in [0, 2**64)", "seed"),
        ("/v1/completions", {"prompt": "x", "stop": ""}, "stop must be non-empty strings", "stop"),
        # chat: the limit is named as the client sent it
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens must be >= 1, got 0",
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens must be >= 1, got 0",
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content: only text parts are supported, got a part of type 'image_url'",
            "messages.0.content",
        ),
        # found by an attack pass: rendered and served before
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "sunny"}]},
            "a tool message needs tool_call_id",
            "messages.1",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}]},
            "a user message needs content",
            "messages.0",
        ),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_a_400_naming_its_field(
    client: httpx.Client, path: str, body: Any, needle: str, param: str
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param, error


def test_chat_content_as_text_parts_equals_the_same_text_as_a_string(client: httpx.Client) -> None:
    """OpenAI's list form of `content` (current SDKs send it): text parts joined with "\n", as vLLM does;
    a JSON integer is a valid temperature."""
    as_parts = [{"type": "text", "text": "import os"}, {"type": "text", "text": "def main():"}]
    answers = []
    for content in (as_parts, "import os\ndef main():"):
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        answers.append((r.json()["choices"][0]["message"], r.json()["usage"]))
    assert answers[0] == answers[1]


def test_invalid_unicode_in_chat_gets_400(client: httpx.Client) -> None:
    """Issue 12, finding 3, for chat: a lone surrogate in a message is a 400 naming the message."""
    content = json.dumps(
        {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud83d"}]}
    )
    r = client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "messages.1.content: Value error, not valid Unicode: U+D83D at character 0" in error["message"]
    assert error["param"] == "messages.1.content"


def test_chat_rejects_out_of_range_n_and_logprobs(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "x"}]
    for extra in (
        {"n": 17},
        {"top_logprobs": 2},  # without logprobs: true
        {"top_logprobs": 21, "logprobs": True},
        {"tool_choice": "required"},  # without tools
        {"logit_bias": {"5": -101}},
    ):
        r = client.post("/v1/chat/completions", json={"messages": messages, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text
    plain = {"messages": messages, "max_tokens": 1, "response_format": {"type": "text"}, "logit_bias": {}}
    assert client.post("/v1/chat/completions", json=plain).status_code == 200


def test_api_key(backend: LocalEngineBackend) -> None:
    with ServerThread(build_app(backend, api_key=API_KEY)) as srv, httpx.Client(base_url=srv.url) as c:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200  # probes stay open
        r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text


class FailingBackend:
    """Fault injection: raises BackendUnavailable before the first token, or after `num_ok_deltas`."""

    model_name = "tiny"
    max_model_len = MAX_MODEL_LEN

    def __init__(self, tokenizer: Any, num_ok_deltas: int = 0) -> None:
        self.tokenizer = tokenizer
        self.num_ok_deltas = num_ok_deltas
        self.aborted: list[str] = []

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        for _ in range(self.num_ok_deltas):
            yield StreamDelta([42])
        raise BackendUnavailable("no decode instance is up (test)")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict[str, Any]:
        raise BackendUnavailable("cluster is down (test)")

    def check_ready(self) -> None:
        raise BackendUnavailable("cluster is down (test)")


def test_backend_unavailable_gives_503(reference: LLM) -> None:
    fake = FailingBackend(reference.tokenizer)
    assert isinstance(fake, ServingBackend)
    with ServerThread(build_app(fake)) as srv, httpx.Client(base_url=srv.url) as c:
        for stream_flag in (False, True):
            r = c.post("/v1/completions", json={"prompt": "x", "stream": stream_flag})
            assert r.status_code == 503
            assert r.json()["error"]["message"] == "no decode instance is up (test)"
            assert r.headers["retry-after"] == "1"  # retriable: says when (issue 12, admission)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "cluster is down (test)"
        assert c.get("/metrics").status_code == 200  # a scrape survives a down backend
        fake.num_ok_deltas = 2  # fails mid-stream: an error event, then [DONE]
        events = stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 8})
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
        assert len(fake.aborted) >= 1


class StalledStatsBackend(FailingBackend):
    """Fault injection: `stats()` blocks until `released` (an instance that stopped answering: the
    cluster's waits up to its call timeout), while `check_ready` says ready."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.released = threading.Event()
        self.stats_called = threading.Event()

    def stats(self) -> dict[str, Any]:
        self.stats_called.set()
        self.released.wait(STALL_S)
        return {}

    def check_ready(self) -> None:
        return None


STALL_S = 60.0  # how long the stalled stats() blocks unless released; /health must not wait for it


def test_health_answers_at_once_while_stats_stalls(reference: LLM) -> None:
    """/health asks `check_ready` (bookkeeping) and never `stats()`, which on a cluster waits for every
    rank's answer: a probe with a 5 s timeout gets 200 while stats() is blocked for STALL_S (60 s)."""
    fake = StalledStatsBackend(reference.tokenizer)
    try:
        with ServerThread(build_app(fake)) as srv, httpx.Client(base_url=srv.url, timeout=5.0) as c:
            for _ in range(3):
                assert c.get("/health").json() == {"status": "ok"}
            assert not fake.stats_called.is_set()
    finally:
        fake.released.set()


class ShrunkClusterBackend(StalledStatsBackend):
    """A cluster whose decode instance lost one of its 2 ranks and serves on the other (elastic EP):
    `health()` is the registry's bookkeeping (`InstanceRegistry.health`)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.released.set()
        self.instances = {
            "prefill-0": {"state": "healthy", "ranks": 2, "deployed_ranks": 2, "degraded": False},
            "decode-0": {"state": "healthy", "ranks": 1, "deployed_ranks": 2, "degraded": True},
        }

    def health(self) -> dict[str, dict[str, Any]]:
        return self.instances


def test_health_of_a_cluster_names_each_instance_and_a_degraded_one(reference: LLM) -> None:
    fake = ShrunkClusterBackend(reference.tokenizer)
    with ServerThread(build_app(fake)) as srv, httpx.Client(base_url=srv.url, timeout=5.0) as c:
        r = c.get("/health")  # still serving: 200, but says which instance runs on fewer ranks
        assert r.status_code == 200 and r.json() == {"status": "degraded", "instances": fake.instances}
        fake.instances["decode-0"] |= {"ranks": 2, "degraded": False}
        assert c.get("/health").json()["status"] == "ok"


# ---- metrics, disconnects, speculative decoding ------------------------------------------------------------
def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_after_requests(client: httpx.Client) -> None:
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    text = client.get("/metrics").text
    for name in (
        "pdcluster_time_to_first_token_seconds_count",
        "pdcluster_time_per_output_token_seconds_count",
        "pdcluster_inter_token_latency_seconds_count",
        "pdcluster_e2e_request_latency_seconds_count",
        "pdcluster_generation_tokens_total",
    ):
        assert metric_value(text, name) >= 1, name
    assert 'pdcluster_request_phase_seconds_count{phase="prefill"}' in text
    assert 'pdcluster_kv_cache_used_blocks{instance="local"}' in text
    assert 'pdcluster_kv_cache_total_blocks{instance="local"} 96.0' in text
    assert "pdcluster_num_requests_waiting " in text and "pdcluster_num_requests_running " in text
    assert 'pdcluster_slo_requests_total{attained="true"}' in text
    assert 'pdcluster_requests_total{finish_reason="length"}' in text


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(
    server: ServerThread, backend: LocalEngineBackend
) -> None:
    body = {"prompt": PROMPT * 4, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert backend.stats()["kv_blocks"]["local"]["num_used_blocks"] > 0
        # leaving the block closes the connection after one chunk of 200 tokens
    wait_idle(backend)
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, 'pdcluster_requests_total{finish_reason="abort"}') >= 1


def test_client_disconnect_non_streaming_aborts(server: ServerThread, backend: LocalEngineBackend) -> None:
    def num_aborted() -> float:
        text = httpx.get(server.url + "/metrics").text
        name = 'pdcluster_requests_total{finish_reason="abort"}'
        return metric_value(text, name) if name in text else 0.0

    before = num_aborted()
    body = {"prompt": PROMPT, "max_tokens": 230, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=0.3) as c:
        c.post("/v1/completions", json=body)
    wait_idle(backend)
    assert num_aborted() == before + 1


def test_speculative_decoding_reports_acceptance(reference: LLM) -> None:
    engine = reference.replace_config(num_speculative_tokens=2).engine
    spec = LocalEngineBackend(engine.config, engine=engine, name="mtp0")
    try:
        with ServerThread(build_app(spec)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
            whole = c.post("/v1/completions", json=body).json()
            expected = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0]
            assert whole["choices"][0]["text"] == expected.text  # lossless
            ext = whole["pdcluster"]
            assert ext["num_draft_tokens"] > 0 and 0 <= ext["acceptance_rate"] <= 1
            assert len(ext["acceptance_rate_per_position"]) == 2
            events = stream(c, "/v1/completions", body)
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected.text
            text = c.get("/metrics").text
            assert metric_value(text, 'pdcluster_spec_decode_num_draft_tokens_total{position="1"}') > 0
            assert 'pdcluster_spec_decode_num_accepted_tokens_total{position="0"}' in text
            assert 'pdcluster_kv_cache_used_blocks{instance="mtp0"}' in text
    finally:
        spec.shutdown()


def test_bench_replays_a_trace_against_the_server(server: ServerThread) -> None:
    from pdcluster.entrypoints.bench_client import run_bench

    report = run_bench(
        server.url,
        "AzureLLMInferenceTrace_conv.csv",
        tokenizer_dir=str(bundled_checkpoint_dir()),
        num_requests=4,
        time_scale=50,
        max_tokens_cap=8,
        show_progress=False,
    )
    s = report.summary
    assert s["num_ok"] == 4 and s["num_failed"] == 0
    # ignore_eos: each request gets exactly its scaled output length (44, 109, 55, 16 capped at 8)
    assert s["num_output_tokens"] == 4 * 8
    # input lengths 374, 396, 879, 91 scaled by 256/8192, clamped to [16, 248]
    assert s["num_input_tokens"] == 16 + 16 + 27 + 16
    assert s["ttft_ms"]["p50"] > 0 and s["goodput_fraction"] <= 1
    assert "scaled by 256/8192" in report.as_table()
    assert set(report.as_json()) >= {"workload", "prompts", "ttft_ms", "tpot_ms", "goodput_requests_per_s"}


class BrokenBackend(FailingBackend):
    """Fault injection: a non-retriable bug in the backend."""

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        raise RuntimeError("boom")
        yield  # pragma: no cover - makes this an async generator


def test_backend_bug_gives_500_json(reference: LLM) -> None:
    with ServerThread(build_app(BrokenBackend(reference.tokenizer))) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "internal error: RuntimeError: boom"


# ---- edge hygiene: tokenization off the event loop, body size, admission, docs behind the key ----------
def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(
    server: ServerThread, backend: LocalEngineBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-MB prompt took seconds of the tokenizer pool, which every other request's prompt waited for
    (found by an attack pass: a small request took 13 s beside four 3.8 MB prompts). It is now refused with
    a 400 from its length alone: more characters than max_model_len tokens of the vocabulary's longest
    entry can hold; the tokenizer never sees it. A prompt just within that bound is tokenized (and refused
    by its token count)."""
    seen: list[int] = []
    encode_batch = backend.tokenizer.encode_batch
    monkeypatch.setattr(  # a spy on the real tokenizer: the lengths of the texts it is given
        backend.tokenizer, "encode_batch", lambda texts: seen.extend(map(len, texts)) or encode_batch(texts)
    )
    max_chars = backend.tokenizer.max_token_chars
    prompt = "def f(x):\n    return x + 1\n" * 110_000  # 3.08 MB, under the default body limit (4 MiB)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        f"the prompt has {len(prompt):,} characters, so at least {-(-len(prompt) // max_chars):,} tokens "
        f"(a token holds at most {max_chars} characters): more than max_model_len {MAX_MODEL_LEN}"
    )
    assert seen == []
    within = "x" * (MAX_MODEL_LEN * max_chars)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": within, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "the prompt has" in r.json()["error"]["message"], r.text
    assert seen == [len(within)]


def _raw_request(server: ServerThread, head: str, body_chunks: Iterable[bytes] = ()) -> tuple[str, int]:
    """Send `head`, then `body_chunks` one by one until the server answers; returns (the response's first
    bytes, body bytes sent by then)."""
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sent = 0
    try:
        sock.sendall(head.encode())
        for chunk in body_chunks:
            if select.select([sock], [], [], 0.05)[0]:
                break
            try:
                sock.sendall(chunk)
            except OSError:  # the server closed the connection after answering
                break
            sent += len(chunk)
        return sock.recv(65536).decode(errors="replace"), sent
    finally:
        sock.close()


def test_body_over_the_limit_gets_413(backend: LocalEngineBackend) -> None:
    """Edge hygiene (issue 12): a request body over max_request_body_bytes is refused with 413 and an
    OpenAI-style error, without reading it: a Content-Length over the limit is refused before any body
    byte is sent; a chunked body as soon as the limit is passed, not when it ends."""
    limit = 64 * 1024
    with (
        ServerThread(build_app(backend, max_request_body_bytes=limit)) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        r = c.post("/v1/completions", json={"prompt": "x" * limit, "max_tokens": 1})
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["code"] == 413 and error["type"] == "invalid_request_error"
        assert f"limit of {limit} bytes (api.max_request_body_bytes)" in error["message"]
        r = c.post("/v1/completions", json={"prompt": "x" * (limit // 2), "max_tokens": 1})
        assert r.status_code == 400 and "the prompt has" in r.text  # under the limit: read and judged

        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        reply, sent = _raw_request(srv, head + "Content-Length: 1000000000\r\n\r\n")
        assert reply.startswith("HTTP/1.1 413") and sent == 0, reply

        chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"  # 16 KiB chunks, never a last chunk
        reply, sent = _raw_request(srv, head + "Transfer-Encoding: chunked\r\n\r\n", [chunk] * 256)
        assert reply.startswith("HTTP/1.1 413"), reply
        assert sent < 8 * limit, f"{sent} bytes sent before the 413"
        assert c.get("/health").status_code == 200
        assert 'pdcluster_request_errors_total{status_code="413"} 3.0' in c.get("/metrics").text


class GatedBackend:
    """Wraps a backend: every request waits for `gate` before it is passed on; counts requests in
    `generate` (now and at most). Everything else is the inner backend's."""

    def __init__(self, inner: LocalEngineBackend) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.num_running = self.max_running = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        self.num_running += 1
        self.max_running = max(self.max_running, self.num_running)
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
            async for delta in self.inner.generate(request_id, prompt_token_ids, params):
                yield delta
        finally:
            self.num_running -= 1


def test_edge_refuses_beyond_max_concurrent_requests_with_429(backend: LocalEngineBackend) -> None:
    """Admission (issue 12): with max_concurrent_requests 2 and two requests in flight, a third completion
    (streamed or not, either endpoint) gets 429 with Retry-After and an OpenAI-style error, before any
    stream starts; /health, /metrics and /v1/models are not counted. Once the two end, requests are
    admitted again."""
    gated = GatedBackend(backend)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with (
        ServerThread(build_app(gated, max_concurrent_requests=2)) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        held: list[list[Any]] = []
        threads = [
            threading.Thread(
                target=lambda: held.append(stream(httpx.Client(base_url=srv.url), "/v1/completions", body))
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while gated.num_running < 2:
            assert time.monotonic() < deadline, "the two requests did not reach the backend"
            time.sleep(0.01)
        for path, extra in (
            ("/v1/completions", {"stream": True}),
            ("/v1/completions", {}),
            ("/v1/chat/completions", {"stream": True}),
        ):
            payload = {**body, **extra}
            if "chat" in path:
                payload = {"messages": [{"role": "user", "content": PROMPT}], **extra}
            r = c.post(path, json=payload)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
            error = r.json()["error"]
            assert error["code"] == 429 and "limit of 2 concurrent requests" in error["message"]
        assert c.get("/health").status_code == 200 and c.get("/v1/models").status_code == 200
        assert "pdcluster_requests_in_flight 2.0" in c.get("/metrics").text
        gated.gate.set()
        for t in threads:
            t.join(30)
        assert len(held) == 2 and all(events[-1] == "[DONE]" for events in held)
        assert gated.max_running == 2
        assert c.post("/v1/completions", json=body).status_code == 200
        assert 'pdcluster_request_errors_total{status_code="429"} 3.0' in c.get("/metrics").text
    wait_idle(backend)


def test_many_streams_complete_or_are_refused_cleanly(backend: LocalEngineBackend) -> None:
    """The load test in small (`bench.load_streams`; `make load-test` runs 1,000 against the cluster): 50
    streams at once against max_concurrent_requests 8. Each one completes or is refused (429 with
    Retry-After) before its stream starts; none is killed mid-stream; the backend never runs more than
    8 at once."""
    from bench.load_streams import run_streams, summarize

    gated = GatedBackend(backend)
    gated.gate.set()
    with ServerThread(build_app(gated, max_concurrent_requests=8)) as srv:
        started = time.monotonic()
        outcomes = asyncio.run(run_streams(srv.url, num_streams=50, max_tokens=32, deadline_s=120))
        report = summarize(outcomes, time.monotonic() - started)
    assert report["clean"] and report["killed_mid_stream"] == 0, report
    assert report["completed"] + report["refused"] == 50, report
    assert report["completed"] >= 8 and report["refused"] >= 1, report
    assert set(report["refusal_statuses"]) == {429}, report
    assert gated.max_running <= 8
    wait_idle(backend)


def test_docs_and_openapi_need_the_api_key(backend: LocalEngineBackend) -> None:
    """Issue 12, finding 9 (the API-key part): with an API key set, /docs, /redoc and /openapi.json need
    it too (401 otherwise); /health and /metrics stay open for probes and scrapers. Without a key the docs
    are open."""
    with ServerThread(build_app(backend, api_key=API_KEY)) as srv, httpx.Client(base_url=srv.url) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200, path
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    with ServerThread(build_app(backend)) as srv:
        assert httpx.get(srv.url + "/openapi.json").status_code == 200


def test_an_empty_api_key_is_refused():
    """Issue 12, finding 8: `api_key: ""` let an empty bearer token in; now a ValueError at build time."""
    with pytest.raises(ValueError, match="api_key must not be empty"):
        build_app(LocalEngineBackend.__new__(LocalEngineBackend), api_key="")


@pytest.mark.parametrize("drain_timeout_s", [10.0, 0.0])
def test_stop_refuses_new_connections_and_drains_streams_in_flight(
    backend: LocalEngineBackend, drain_timeout_s: float, capfd: pytest.CaptureFixture[str]
) -> None:
    """`ServerThread.stop` (what `pdcluster deploy` does at Ctrl-C / SIGTERM): the port is closed at once,
    and a stream in flight (held in the backend until after that) finishes whole within the drain timeout;
    with 0, stop returns at once and the stream is cut, logged as one warning line (uvicorn's ERROR and a
    traceback per cut request before)."""
    gated = GatedBackend(backend)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    srv = ServerThread(build_app(gated), drain_timeout_s=drain_timeout_s).start()
    outcome: list[Any] = []

    def client() -> None:
        try:
            outcome.append(stream(httpx.Client(base_url=srv.url, timeout=30), "/v1/completions", body))
        except (httpx.HTTPError, AssertionError) as e:  # cut mid-way, or before its 200
            outcome.append(e)

    streaming = threading.Thread(target=client)
    streaming.start()
    deadline_s = time.monotonic() + 10
    while gated.num_running < 1:
        assert time.monotonic() < deadline_s, "the request did not reach the backend"
        time.sleep(0.01)
    stopping = threading.Thread(target=srv.stop)
    stopping.start()
    while True:  # the listening socket closes first: a new connection is refused
        try:
            with socket.create_connection((srv.host, srv.port), timeout=1):
                pass
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline_s, "the port still accepts connections"
        time.sleep(0.01)
    if not drain_timeout_s:  # stop returns without waiting for the request still held in the backend
        stopping.join(30)
        assert not stopping.is_alive()
    gated.gate.set()
    streaming.join(30)
    stopping.join(30)
    assert not streaming.is_alive() and not stopping.is_alive()
    if drain_timeout_s:
        events = outcome[0]
        assert events[-1] == "[DONE]", events
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1] if e["choices"]) >= 1
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "length"
    else:
        assert not isinstance(outcome[0], list) or outcome[0][-1] != "[DONE]", outcome
        err = capfd.readouterr().err
        assert "the drain timeout ran out: 1 request(s) still in flight were cut" in err, err
        assert "Exception in ASGI application" not in err and "Traceback" not in err, err
    wait_idle(backend)


def test_tokenize_detokenize_and_guided_choice(client: httpx.Client, reference: LLM) -> None:
    """vLLM's /tokenize (prompt, or messages through the chat template) and /detokenize; a completion
    under `guided_choice` answers one of the choices."""
    messages = [{"role": "user", "content": "import os\n"}]
    r = client.post("/tokenize", json={"messages": messages})
    expected = reference.tokenizer.encode(ChatTemplate(reference.tokenizer).render(messages))
    assert r.json() == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected}
    decoded = client.post("/detokenize", json={"tokens": expected}).json()
    assert decoded == {"prompt": "<|User|>import os\n<|Assistant|>"}  # BOS (special) skipped
    bad = client.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = client.post("/tokenize", json={"prompt": "x", "messages": messages})
    assert both.status_code == 400
    body = {"prompt": PROMPT, "max_tokens": 8, "guided_choice": ["alpha", "beta"], "temperature": 0}
    answer = client.post("/v1/completions", json=body).json()["choices"][0]
    assert answer["text"] in ("alpha", "beta") and answer["finish_reason"] == "stop"
