"""Prompt logprobs (`SamplingParams.prompt_logprobs`, `engine.prompt_logprobs`) on the bundled model.

What they prove: every prompt token's logprob and top-k equal `log_softmax` of a cache-less full forward of
the model at the position before it (within 1e-4: the engine's paged, chunked forward sums in another order
than the full one), token 0 has none; the same with chunked prefill, MTP on, async scheduling and a prompt
whose prefix is in the prefix cache (skipped for such requests); requests beside them are unchanged.
"""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.prompt_logprobs import merge
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts

NUM_TOP = 5
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(bundled_checkpoint_dir(), num_kv_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    # long enough to span several blocks and, with max_num_batched_tokens=16, several prefill chunks
    texts = heldout_def_prompts(3)
    return [llm.tokenizer.encode(" ".join([t] * 4)) for t in texts]


def reference(llm: LLM, prompt_ids: list[int]) -> torch.Tensor:
    """`[num_prompt - 1, V]` log_softmax of a full forward: row j - 1 scores prompt token j."""
    with torch.no_grad():
        logits = llm.engine.model(torch.tensor([prompt_ids]))[0]
    return logits[:-1].float().log_softmax(-1)


def check(llm: LLM, prompt_ids: list[int], got, num_top: int = NUM_TOP) -> None:
    assert got is not None and len(got) == len(prompt_ids)
    assert got[0] is None
    ref = reference(llm, prompt_ids)
    assert [e.token_id for e in got[1:]] == prompt_ids[1:]
    values = torch.tensor([e.logprob for e in got[1:]])
    torch.testing.assert_close(
        values, ref.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0], atol=ATOL, rtol=0
    )
    top = ref.topk(num_top, dim=-1)
    torch.testing.assert_close(torch.tensor([e.top_logprobs for e in got[1:]]), top.values, atol=ATOL, rtol=0)
    ranks = (ref > values[:, None] + ATOL).sum(-1) + 1
    assert all(abs(e.rank - int(r)) <= 1 for e, r in zip(got[1:], ranks, strict=True))  # ties within ATOL


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"max_num_batched_tokens": 16},
        {"num_speculative_tokens": 2},
        {"async_scheduling": True, "num_speculative_tokens": 1},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default",
)
def test_prompt_logprobs_equal_cacheless_log_softmax(llm, prompts, changes):
    engine_llm = llm.replace_config(**changes) if changes else llm
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    plain = engine_llm.generate(prompts, greedy)
    asked = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, prompt_logprobs=NUM_TOP)
    mixed = engine_llm.generate(prompts, [asked, greedy, asked])
    assert mixed[1].prompt_logprobs is None
    for i in (0, 2):
        check(llm, prompts[i], mixed[i].prompt_logprobs)
    # asking for prompt logprobs changes no one's tokens (theirs nor their neighbours')
    assert [o.token_ids for o in mixed] == [o.token_ids for o in plain]


def test_prompt_logprobs_skip_the_prefix_cache(llm, prompts):
    engine_llm = llm.replace_config()
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    first = engine_llm.generate(prompts[:1], greedy)[0]
    again = engine_llm.generate(prompts[:1], greedy)[0]
    assert again.num_cached_tokens > 0 and first.token_ids == again.token_ids  # the prefix is cached
    asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    out = engine_llm.generate(prompts[:1], asked)[0]
    assert out.num_cached_tokens == 0
    assert all(e.top_token_ids == [] for e in out.prompt_logprobs[1:])
    ref = reference(llm, prompts[0]).gather(1, torch.tensor(prompts[0][1:])[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor([e.logprob for e in out.prompt_logprobs[1:]]), ref, atol=ATOL, rtol=0
    )


def test_one_token_prompt_has_only_none(llm):
    out = llm.generate([[5]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_over_the_vocabulary_are_rejected(llm, prompts):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.engine.add_request(
            prompts[0], SamplingParams(prompt_logprobs=llm.engine.model.config.vocab_size + 1)
        )
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an int >= 0"):
        SamplingParams(prompt_logprobs=-1)


def test_merge_keeps_what_is_known_and_refuses_a_gap():
    have: list = [None, "a"]
    merge(have, 1, ["a2", "b"])  # a recomputed prompt (preemption) scores token 1 again: kept once
    assert have == [None, "a", "b"]
    with pytest.raises(ValueError, match="from token 5"):
        merge(have, 5, ["x"])
