"""A request whose logit processors, grammar mask or logprobs raise fails alone: the requests batched with it
complete with the tokens (and logprobs) they have without it, with MTP off and on. The faults: a logit_bias
token id outside the vocabulary (the edge and `add_request` refuse it; forced in after `add_request` here),
and injected exceptions in the grammar mask and the logprobs of one request. Greedy token ids are compared
exactly (one engine object: the same model and kernels; batches of other composition give the same argmax on
these prompts), logprobs within 1e-4.
"""

from __future__ import annotations

import pytest

from pdcluster.engine import sampler
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.structured_output import StructuredOutputs
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts

MAX_TOKENS = 8
PENALIZED = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.5)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={3: 1.0})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(bundled_checkpoint_dir(), num_kv_blocks=256, block_size=16)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_def_prompts(4)


def _run(llm: LLM, requests: list[tuple[str, SamplingParams]], after_add=lambda: None):
    engine = llm.engine
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    after_add()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[rid] for rid in ids]


def _check_neighbours(llm: LLM, prompts: list[str], outs: list) -> None:
    """outs: of (prompt 0, PENALIZED), (prompt 1, poisoned), (prompt 2, WITH_LOGPROBS), (prompt 3, SAMPLED);
    the greedy ones equal their outputs without the poisoned request, the sampled one completes."""
    alone = _run(llm, [(prompts[0], PENALIZED), (prompts[2], WITH_LOGPROBS)])
    for got in outs[0], outs[2], outs[3]:
        assert got.error is None and got.finish_reason == "length" and len(got.token_ids) == MAX_TOKENS
    assert [outs[0].token_ids, outs[2].token_ids] == [o.token_ids for o in alone]
    assert [t.token_id for t in outs[2].logprobs] == outs[2].token_ids
    got_lp = [t.logprob for t in outs[2].logprobs]
    # one model object, batches of other composition: float sums in another order, hence a tolerance
    assert got_lp == pytest.approx([t.logprob for t in alone[1].logprobs], abs=1e-4)
    engine = llm.engine
    engine.scheduler.block_manager.check_no_leaks()
    assert engine.executor.num_tracked_requests == 0


@pytest.mark.parametrize("num_speculative_tokens", [0, 1])
def test_a_logit_bias_fault_fails_only_its_request(llm, prompts, num_speculative_tokens):
    llm_k = llm.replace_config(num_speculative_tokens=num_speculative_tokens)
    vocab_size = llm_k.engine.model.config.vocab_size
    poisoned = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.2, logit_bias={5: 1.0}
    )
    outs = _run(
        llm_k,
        [(prompts[0], PENALIZED), (prompts[1], poisoned), (prompts[2], WITH_LOGPROBS), (prompts[3], SAMPLED)],
        # past add_request's check: the request holds this params object, read when it is first scheduled
        after_add=lambda: object.__setattr__(poisoned, "logit_bias", ((vocab_size + 5, 1.0),)),
    )
    assert outs[1].finish_reason == "error" and "logits processing failed" in outs[1].error
    assert outs[1].token_ids == []
    _check_neighbours(llm_k, prompts, outs)


@pytest.mark.parametrize("num_speculative_tokens", [0, 1])
def test_a_logprobs_fault_fails_only_its_request(llm, prompts, num_speculative_tokens, monkeypatch):
    compute_logprobs = sampler.compute_logprobs

    def failing(logits, token_ids, num_top):  # the request asking for 7 alternatives raises
        if num_top == 7:
            raise RuntimeError("injected logprobs fault")
        return compute_logprobs(logits, token_ids, num_top)

    monkeypatch.setattr(sampler, "compute_logprobs", failing)
    llm_k = llm.replace_config(num_speculative_tokens=num_speculative_tokens)
    poisoned = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=7)
    outs = _run(
        llm_k,
        [(prompts[0], PENALIZED), (prompts[1], poisoned), (prompts[2], WITH_LOGPROBS), (prompts[3], SAMPLED)],
    )
    assert outs[1].finish_reason == "error" and "injected logprobs fault" in outs[1].error
    _check_neighbours(llm_k, prompts, outs)


def test_a_grammar_fault_fails_only_its_request(llm, prompts, monkeypatch):
    fill_masks = StructuredOutputs._fill_masks

    def failing(self, item, bitmask, offset):  # the grammar of the 7-token request raises
        if item.request.sampling_params.max_tokens == 7:
            raise RuntimeError("injected grammar fault")
        return fill_masks(self, item, bitmask, offset)

    monkeypatch.setattr(StructuredOutputs, "_fill_masks", failing)
    llm_k = llm.replace_config(num_speculative_tokens=1)
    poisoned = SamplingParams(temperature=0, max_tokens=7, structured_output=("regex", "[a-z ]*"))
    outs = _run(
        llm_k,
        [(prompts[0], PENALIZED), (prompts[1], poisoned), (prompts[2], WITH_LOGPROBS), (prompts[3], SAMPLED)],
    )
    assert outs[1].finish_reason == "error" and "injected grammar fault" in outs[1].error
    _check_neighbours(llm_k, prompts, outs)
