"""The official `openai` client against the HTTP edge (a real uvicorn server over a LocalEngineBackend on
the bundled model, MTP on): logprobs with top_logprobs on both endpoints and n=3, streamed and not.

What it proves: the SDK parses every response and chunk; greedy logprobs equal the offline engine's
(MTP off, another engine object: within 1e-4, the same float32 model evaluated in different batch
shapes); a stream carries the same tokens and logprobs as the whole response; n=3 returns choices 0..2
(streamed: each index finishes once) and the prompt's full blocks come from the prefix cache for
choices 1 and 2 (the prompt is prefilled once).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from pdcluster.driver.backend import LocalEngineBackend
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.entrypoints.openai.app import build_app
from pdcluster.entrypoints.openai.server import ServerThread
from pdcluster.models import bundled_checkpoint_dir
from tests.openai_checks import chat_logprobs_whole_and_streamed

PROMPT = "def fibonacci(n):\n"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(bundled_checkpoint_dir(), max_model_len=256, num_kv_blocks=128)


@pytest.fixture(scope="module")
def backend(reference: LLM) -> Iterator[LocalEngineBackend]:
    engine = reference.replace_config(num_speculative_tokens=2).engine
    backend = LocalEngineBackend(engine.config, engine=engine)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def client(backend: LocalEngineBackend) -> Iterator[openai.OpenAI]:
    with ServerThread(build_app(backend)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completion_logprobs_whole_and_streamed(client, reference):
    expected = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, logprobs=3))[0]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    logprobs = whole.choices[0].logprobs
    assert whole.choices[0].text == expected.text
    assert len(logprobs.tokens) == whole.usage.completion_tokens == len(expected.token_ids)
    assert logprobs.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=TOLERANCE)
    assert all(
        len(top) >= 3 for top in logprobs.top_logprobs
    )  # 3 alternatives (+ the token, if not among them)
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == whole.choices[0].text
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3, stream=True
        )
    )
    streamed = [
        v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=TOLERANCE)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_chat_logprobs_whole_and_streamed(client):
    messages = [{"role": "user", "content": PROMPT}]
    whole = chat_logprobs_whole_and_streamed(client, messages, TOLERANCE, max_tokens=8, top_logprobs=2)
    for entry in whole.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=TOLERANCE)  # greedy: the top


def test_n_choices_prefill_the_prompt_once(client, backend):
    prompt = "def choices_of_a_fresh_prompt(values, weights, k):\n    " * 2  # not cached by another test
    num_prompt = len(backend.tokenizer.encode(prompt))
    block_size = backend.engine.config.block_size
    hits_before = backend.engine.scheduler.stats().num_prefix_cache_hit_tokens
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=0, n=3)
    hits = backend.engine.scheduler.stats().num_prefix_cache_hit_tokens - hits_before
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.text for c in whole.choices}) > 1  # seeds seed + i: the choices differ
    assert whole.usage.prompt_tokens == num_prompt
    assert hits == 2 * ((num_prompt - 1) // block_size) * block_size  # choices 1 and 2 hit every full block
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        n=3,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    finished: dict[int, int] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finished[choice.index] = finished.get(choice.index, 0) + 1
    assert finished == {0: 1, 1: 1, 2: 1}
    assert usage is not None and usage.completion_tokens == 18


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {  # bounded: whatever the draws, a call fits in max_tokens
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def long_client(reference: LLM) -> Iterator[openai.OpenAI]:
    """A server whose context holds a tool call the tiny model spells out character by character."""
    engine = reference.replace_config(num_speculative_tokens=2, max_model_len=512).engine
    backend = LocalEngineBackend(engine.config, engine=engine)
    with ServerThread(build_app(backend)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    backend.shutdown()


def test_n_choices_each_carry_their_tool_call_whole_and_streamed(long_client):
    """n=2 with a required tool: every choice answers `tool_calls` (found by an attack pass: the choices
    came back as raw marker text); streamed, each index gets a header delta, then argument fragments that
    join to valid JSON."""
    common = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": 4,
        "n": 2,
    }
    whole = long_client.chat.completions.create(**common)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
        assert isinstance(json.loads(call.function.arguments), dict)
    arguments: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in long_client.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content  # the markers never leak as text
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                if delta.id is not None:
                    assert arguments[choice.index] == "" and delta.function.name == "get_weather"
                arguments[choice.index] += delta.function.arguments or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert all(isinstance(json.loads(a), dict) for a in arguments.values())
