"""Logprobs and logit processors through the disaggregated path (clusters/local.yaml, MTP on) with the
official `openai` client, against one engine with MTP off.

What it proves: the first token's logprobs (computed on prefill, carried with the KV handoff) and the
decode tokens' (accepted MTP drafts' included: the target model's) equal one engine's within 1e-4 (other
processes, thread counts and batch shapes: float32 sums in another order); penalties, min_tokens and
logit_bias act on prefill's first token as on decode's (greedy tokens equal one engine's); chat streams
logprobs, and n=3 returns three choices.
"""

from __future__ import annotations

import dataclasses

import openai
import pytest

from pdcluster.config import load_topology
from pdcluster.driver.cluster import Cluster
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.entrypoints.openai.app import build_app
from pdcluster.entrypoints.openai.server import ServerThread
from pdcluster.models import bundled_checkpoint_dir
from tests.cluster.conftest import request_bound_s
from tests.openai_checks import chat_logprobs_whole_and_streamed

pytestmark = pytest.mark.slow

PROMPT = "def merge_sorted(a, b):\n"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def client(ray_session):
    topo = load_topology("clusters/local.yaml")
    assert topo.decode.num_speculative_tokens >= 1  # MTP on
    topo = dataclasses.replace(topo, decode=dataclasses.replace(topo.decode, compile=False))
    cluster = Cluster.deploy(topo)
    try:
        with ServerThread(build_app(cluster)) as server:
            yield openai.OpenAI(
                base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=request_bound_s(cluster)
            )
    finally:
        cluster.shutdown()


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


def test_chat_streamed_logprobs_and_n(client):
    messages = [{"role": "user", "content": PROMPT}]
    chat_logprobs_whole_and_streamed(client, messages, TOLERANCE, max_tokens=8, top_logprobs=2)
    three = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=3, seed=1, logprobs=1)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == 4 or c.finish_reason == "stop" for c in three.choices)
