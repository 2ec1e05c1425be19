"""Logit processors (penalties, logit_bias, min_tokens, stop_token_ids) and the logprobs they report.

What they prove: `kernels.sampling.apply_penalties_` follows the CTRL/OpenAI rules on hand-computed values;
through the engine, greedy tokens and logprobs under penalties equal a cache-less full forward with the
penalties applied by hand over each position's output history (within 1e-4: two forwards of one model
object, differing only in batching), with MTP on as off (drafts extend the history row by row) and with
asynchronous scheduling (the step in flight's tokens are part of the next step's history); a large
logit bias forces its token; min_tokens keeps a stop token from being sampled until it is reached.
"""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels.sampling import apply_penalties_
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(bundled_checkpoint_dir(), num_kv_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_def_prompts(3)


def test_apply_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    listed = torch.tensor([[3, 1, 2, 3]])  # outputs 3, 3, 1; prompt 2; a token may repeat
    counts = torch.tensor([[2.0, 1.0, 0.0, 2.0]])
    got = apply_penalties_(
        logits,
        torch.tensor([0]),
        listed,
        counts,
        torch.tensor([0.5]),
        torch.tensor([0.25]),
        torch.tensor([2.0]),
    )
    # token 0 unseen; 1 seen once (negative: x2), 2 in the prompt only, 3 seen twice (positive: /2)
    expected = torch.tensor([[2.0, -2.0 - 0.25 - 0.5, 0.25, 1.5 - 0.5 - 0.5, 1.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _reference(llm: LLM, prompt_ids: list[int], out_ids: list[int], params: SamplingParams) -> torch.Tensor:
    """`[num_out, V]` log_softmax of the cache-less forward's logits, penalised by hand per position."""
    with torch.no_grad():
        logits = llm.engine.model(torch.tensor([prompt_ids + out_ids]))[0].float()
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(out_ids)].clone()
    for j in range(len(out_ids)):
        history = out_ids[:j]
        for token in set(history) | set(prompt_ids):
            value = rows[j, token]
            rows[j, token] = (
                value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
            )
        for token in set(history):
            rows[j, token] -= params.frequency_penalty * history.count(token) + params.presence_penalty
    return rows.log_softmax(-1)


@pytest.mark.parametrize(
    "changes",
    [{}, {"num_speculative_tokens": 2}, {"num_speculative_tokens": 2, "async_scheduling": True}],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "k=0",
)
def test_greedy_penalties_equal_a_hand_penalised_forward(llm, prompts, changes):
    engine_llm = llm.replace_config(**changes)
    penalised = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=1.0,
        repetition_penalty=1.3,
        ignore_eos=True,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = engine_llm.generate(prompts, [penalised, plain, penalised])
    for prompt, out in zip(prompts[::2], outputs[::2], strict=True):
        prompt_ids = llm.tokenizer.encode(prompt)
        reference = _reference(llm, prompt_ids, out.token_ids, penalised)
        assert out.token_ids == reference.argmax(-1).tolist()
        got = torch.tensor([t.logprob for t in out.logprobs])
        torch.testing.assert_close(got, reference.max(-1).values, atol=1e-4, rtol=0)
    if changes:
        assert sum(o.drafts.num_accepted_tokens for o in outputs) > 0  # some rows' histories include drafts
    unpenalised = llm.generate(prompts[:2], plain)
    assert outputs[1].token_ids == unpenalised[1].token_ids  # a penalised neighbour changes nothing
    assert outputs[0].token_ids != unpenalised[0].token_ids  # the penalties changed the tokens


def test_logit_bias_forces_its_token(llm, prompts):
    token = llm.tokenizer.encode(" banana")[0]
    out = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=5, logit_bias={token: 100.0}))[
        0
    ]
    assert out.token_ids == [token] * 5
    sampled = llm.generate(
        prompts[:1], SamplingParams(temperature=1.0, seed=3, max_tokens=5, logit_bias={token: 100.0})
    )[0]
    assert sampled.token_ids == [token] * 5


def test_logit_bias_outside_the_vocabulary_is_refused_by_the_engine(llm, prompts):
    vocab_size = llm.engine.model.config.vocab_size
    params = SamplingParams(max_tokens=2, logit_bias={5: 1.0, vocab_size + 7: 1.0})
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab_size + 7} is outside the vocabulary"):
        llm.engine.add_request(prompts[0], params)
    assert not llm.engine.has_unfinished_requests()


def test_min_tokens_holds_back_stop_tokens(llm, prompts):
    first = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))[0]
    stop = first.token_ids[0]
    stopped = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[stop]))[
        0
    ]
    assert stopped.token_ids == [stop] and stopped.finish_reason == "stop"
    held = llm.generate(
        prompts[:1],
        SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[stop], min_tokens=2, logprobs=1),
    )[0]
    # the first token is the runner-up of the unconstrained distribution; the stop token's logprob is -inf
    assert held.token_ids[0] == first.logprobs[0].top_token_ids[1]
    assert stop not in held.token_ids[:2]
    assert len(held.token_ids) >= 2


def test_stop_token_ids_end_at_the_first_occurrence(llm, prompts):
    free = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
    stop = free[5]
    out = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.token_ids == free[: free.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_sampled_logprobs_are_of_the_tempered_distribution(llm, prompts):
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=3, logprobs=3)
    out = llm.generate(prompts[:1], params)[0]
    prompt_ids = llm.tokenizer.encode(prompts[0])
    with torch.no_grad():
        logits = llm.engine.model(torch.tensor([prompt_ids + out.token_ids]))[0].float()
    reference = (logits[len(prompt_ids) - 1 : -1] / 0.5).log_softmax(-1)
    expected = reference.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([t.logprob for t in out.logprobs]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_bad_values_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**changes)
