"""Completions' `echo` with `logprobs` (prompt logprobs) and `max_tokens: 0`, and several prompts in one
request (what lm-evaluation-harness's `local-completions` sends), over a LocalEngineBackend on the bundled
model through a real uvicorn server and httpx.

Values are compared with `log_softmax` of a cache-less forward of the same weights within 1e-4 (the engine's
paged, chunked forward sums in another order).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch

from pdcluster.driver.backend import LocalEngineBackend
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.entrypoints.openai.app import build_app
from pdcluster.entrypoints.openai.server import ServerThread
from pdcluster.models import bundled_checkpoint_dir
from tests.orchestrator.test_api_server import sse_events

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
ATOL = 1e-4


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(bundled_checkpoint_dir(), max_model_len=256, num_kv_blocks=96)


@pytest.fixture(scope="module")
def server(reference: LLM) -> Iterator[ServerThread]:
    engine = reference.replace_config().engine
    backend = LocalEngineBackend(engine.config, engine=engine)
    with ServerThread(build_app(backend)) as srv:
        yield srv
    backend.shutdown()


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def prompt_reference(reference: LLM, ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """The prompt tokens' logprobs (from token 1) and the `[num_prompt - 1, V]` log_softmax rows."""
    with torch.no_grad():
        rows = reference.engine.model(torch.tensor([ids]))[0][:-1].float().log_softmax(-1)
    return rows.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), rows


def check_prompt_part(reference: LLM, ids: list[int], logprobs: dict, num_top: int) -> None:
    n = len(ids)
    expected, rows = prompt_reference(reference, ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"][:n] == [reference.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    torch.testing.assert_close(
        torch.tensor(logprobs["token_logprobs"][1:n]), torch.tensor(expected), atol=ATOL, rtol=0
    )
    top = rows.topk(num_top, dim=-1).values
    for j in range(1, n):
        alternatives = sorted(logprobs["top_logprobs"][j].values(), reverse=True)[:num_top]
        # the dict holds the top-k plus the prompt token itself (as for output tokens)
        torch.testing.assert_close(torch.tensor(alternatives), top[j - 1], atol=ATOL, rtol=0)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(
        b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"], strict=False)
    )


def test_echo_logprobs_score_the_prompt_then_the_output(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    common = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 3}
    plain = client.post("/v1/completions", json=common).json()["choices"][0]
    echoed = client.post("/v1/completions", json={**common, "echo": True}).json()
    choice = echoed["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 5
    check_prompt_part(reference, ids, lp, 3)
    # the output part is what the request without echo answers, offsets after the echoed text
    n = len(ids)
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    torch.testing.assert_close(
        torch.tensor(lp["token_logprobs"][n:]),
        torch.tensor(plain["logprobs"]["token_logprobs"]),
        atol=ATOL,
        rtol=0,
    )
    assert lp["text_offset"][n] == len(PROMPT)
    assert echoed["usage"]["completion_tokens"] == 5


def test_echo_with_max_tokens_zero_returns_the_scored_prompt_only(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    body = client.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0},
    ).json()
    choice = body["choices"][0]
    assert choice["text"] == reference.tokenizer.decode(ids, skip_special_tokens=False)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_prompt_part(reference, ids, choice["logprobs"], 0)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    # without logprobs: the prompt's text only, no logprobs object
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True}).json()
    assert body["choices"][0]["text"] == PROMPT and body["choices"][0]["logprobs"] is None


def test_streamed_echo_logprobs_equal_the_whole_answer(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        chunks = [e for e in sse_events(response.iter_lines()) if e != "[DONE]"]
    joined: dict[str, list] = {k: [] for k in whole["logprobs"]}
    for chunk in chunks:
        for key, values in (chunk["choices"][0]["logprobs"] or {}).items():
            joined[key] += values
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None
    torch.testing.assert_close(
        torch.tensor(joined["token_logprobs"][1:]),
        torch.tensor(whole["logprobs"]["token_logprobs"][1:]),
        atol=ATOL,
        rtol=0,
    )


def test_several_prompts_as_lm_eval_sends_them(client, reference):
    prompts = [reference.tokenizer.encode(PROMPT), reference.tokenizer.encode("import os\nimport sys\n")]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    answer = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for ids, choice in zip(prompts, answer["choices"], strict=True):
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 1
        check_prompt_part(reference, ids, choice["logprobs"], 1)
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert answer["usage"]["completion_tokens"] == 2
    # n choices per prompt: index = prompt * n + choice, each with the prompt's logprobs
    answer = client.post("/v1/completions", json={**body, "n": 2, "temperature": 1.0}).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    for i, choice in enumerate(answer["choices"]):
        check_prompt_part(reference, prompts[i // 2], choice["logprobs"], 1)
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))
    # one prompt, n choices (the prompt scored once, by choice 0's backend request), streamed too
    one = {**body, "prompt": prompts[0], "n": 2, "temperature": 1.0}
    for choice in client.post("/v1/completions", json=one).json()["choices"]:
        check_prompt_part(reference, prompts[0], choice["logprobs"], 1)
    with client.stream("POST", "/v1/completions", json={**one, "stream": True}) as response:
        events = [e for e in sse_events(response.iter_lines()) if e != "[DONE]"]
    firsts = {}
    for event in events:
        firsts.setdefault(event["choices"][0]["index"], event["choices"][0]["logprobs"])
    assert sorted(firsts) == [0, 1]
    for logprobs in firsts.values():
        check_prompt_part(reference, prompts[0], logprobs, 1)


def test_prompt_logprob_requests_leave_their_neighbours_unchanged(server, reference):
    prompts = [PROMPT, "class Stack:\n", "import numpy as np\n", "for i in range(10):\n"]
    expected = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=12))

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            normal = [
                c.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0})
                for p in prompts
            ]
            scoring = [
                c.post(
                    "/v1/completions", json={"prompt": p * 3, "max_tokens": 0, "echo": True, "logprobs": 5}
                )
                for p in prompts
            ]
            return [r.json() for r in await asyncio.gather(*normal, *scoring)]

    answers = asyncio.run(run())
    assert [a["choices"][0]["text"] for a in answers[: len(prompts)]] == [o.text for o in expected]
    for prompt, answer in zip(prompts, answers[len(prompts) :], strict=True):
        check_prompt_part(
            reference, reference.tokenizer.encode(prompt * 3), answer["choices"][0]["logprobs"], 5
        )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": "x", "logprobs": 21, "echo": True}, "logprobs must be in [0, 20], got 21"),
        ({"prompt": "x", "logprobs": -1, "echo": True}, "logprobs must be in [0, 20], got -1"),
        ({"prompt": "x", "logprobs": 2, "echo": True, "max_tokens": -1}, "max_tokens must be >= 1, got -1"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1 (0 only with echo"),
        ({"prompt": ["x", "y"], "stream": True}, "several prompts cannot be streamed"),
        ({"prompt": ["x", "y"], "best_of": 2}, "several prompts cannot be streamed or use best_of > n"),
        ({"prompt": ["x"] * 65}, "a list of prompts must hold 1 .. 64"),
        ({"prompt": [[5], []], "echo": True, "logprobs": 1}, "the prompt is empty"),
    ],
)
def test_bad_echo_requests_get_a_400_naming_the_problem(client, body, needle):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_best_of_answers_the_choices_with_the_highest_summed_logprob(client):
    """n=2 of best_of=4 equals the two of the same four seeded candidates (choice i's seed is seed + i) whose
    sampled tokens' logprobs sum highest, highest first."""
    body = {"prompt": "The capital", "max_tokens": 8, "temperature": 1.0, "seed": 11, "logprobs": 1}
    every = client.post("/v1/completions", json={**body, "n": 4}).json()["choices"]
    assert len({c["text"] for c in every}) > 2  # the ranking has something to choose between
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    best = client.post("/v1/completions", json={**body, "n": 2, "best_of": 4}).json()["choices"]
    expected = sorted(range(4), key=lambda i: sums[i], reverse=True)[:2]
    assert [c["text"] for c in best] == [every[i]["text"] for i in expected]
    assert [c["index"] for c in best] == [0, 1]
