"""Per-token log-probabilities (`SamplingParams.logprobs`) on the bundled model.

What they prove: the engine's logprobs of greedy tokens are `log_softmax` of a cache-less full forward of
the model at those positions (within 1e-4), top-N included, with and without speculative decoding (where
an accepted draft's come from the verification forward) and with asynchronous scheduling.
"""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts

NUM_TOP = 3


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(bundled_checkpoint_dir(), num_kv_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_def_prompts(4)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"num_speculative_tokens": 2},
        {"async_scheduling": True, "num_speculative_tokens": 2},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "k=0",
)
def test_greedy_logprobs_equal_cacheless_log_softmax(llm, prompts, changes):
    engine_llm = llm.replace_config(**changes) if changes else llm
    params = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=NUM_TOP) for _ in prompts]
    params[1] = SamplingParams(temperature=0.0, max_tokens=12)  # no logprobs asked in the same batch
    outputs = engine_llm.generate(prompts, params)
    assert outputs[1].logprobs is None
    if changes.get("num_speculative_tokens"):
        assert (
            sum(o.drafts.num_accepted_tokens for o in outputs) > 0
        )  # some logprobs come from accepted drafts
    model = llm.engine.model
    for prompt, out in zip(prompts, outputs, strict=True):
        if out.logprobs is None:
            continue
        prompt_ids = llm.tokenizer.encode(prompt)
        assert [t.token_id for t in out.logprobs] == out.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + out.token_ids]))[0]  # [S, V]
        num_prompt, num_out = len(prompt_ids), len(out.token_ids)
        reference = logits[num_prompt - 1 : num_prompt - 1 + num_out].float().log_softmax(-1)  # [num_out, V]
        got = torch.tensor([t.logprob for t in out.logprobs])
        expected = reference.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert all(t.rank == 1 for t in out.logprobs)  # greedy tokens are the argmax
        top = reference.topk(NUM_TOP, dim=-1)
        torch.testing.assert_close(
            torch.tensor([t.top_logprobs for t in out.logprobs]), top.values, atol=1e-4, rtol=0
        )
        assert [t.top_token_ids[0] for t in out.logprobs] == out.token_ids


def test_logprobs_zero_gives_only_the_sampled_token(llm, prompts):
    out = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=0, max_tokens=5, logprobs=0))[0]
    assert len(out.logprobs) == len(out.token_ids) == 5
    assert all(t.top_token_ids == [] and t.top_logprobs == [] for t in out.logprobs)
    assert all(t.logprob <= 0 and t.rank >= 1 for t in out.logprobs)


def test_logprobs_over_the_vocabulary_are_rejected(llm, prompts):
    vocab_size = llm.engine.model.config.vocab_size
    with pytest.raises(ValueError, match="logprobs"):
        llm.engine.add_request(prompts[0], SamplingParams(logprobs=vocab_size + 1))
    assert not llm.engine.has_unfinished_requests()
