"""Grammar-constrained decoding (`engine.structured_output`) on the bundled tiny model: outputs match their
grammar, a structured request leaves its batch neighbours' tokens alone, MTP verification rejects drafts
outside the grammar, a grammar that does not compile is refused, running out of max_tokens is "length"."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.outputs import ScheduledRequest
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.structured_output import GrammarError, StructuredOutputs
from pdcluster.kernels.rejection_sampling import greedy_verify_batch
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(bundled_checkpoint_dir(), max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llm_mtp() -> LLM:
    return LLM(bundled_checkpoint_dir(), max_model_len=256, num_kv_blocks=64, num_speculative_tokens=2)


def greedy(max_tokens: int, grammar: tuple[str, str] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=grammar)


def test_outputs_match_their_grammar(llm: LLM) -> None:
    params = [
        greedy(64, ("json_schema", json.dumps(SCHEMA))),
        greedy(16, ("regex", r"[a-z]{2,5}-[0-9]{2}")),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_output=("choice", '["yes", "no"]')),
    ]
    schema_out, regex_out, choice_out = llm.generate(PROMPTS, params)
    assert schema_out.finish_reason == "stop", schema_out.text
    answer = json.loads(schema_out.text)
    assert set(answer) == {"name", "ok"} and isinstance(answer["ok"], bool) and len(answer["name"]) <= 8
    assert regex_out.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", regex_out.text)
    assert choice_out.text in ("yes", "no") and choice_out.finish_reason == "stop"
    assert schema_out.token_ids[-1] == llm.tokenizer.eos_token_id  # the grammar ends with EOS


def test_ignore_eos_ends_when_the_grammar_is_complete(llm: LLM) -> None:
    """ignore_eos: the grammar's EOS still ends the request ("stop"), never free text after the grammar."""
    params = [
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, structured_output=grammar)
        for grammar in (("choice", '["yes", "no"]'), ("regex", r"[a-z]{2,5}-[0-9]{2}"))
    ]
    for out in llm.generate(PROMPTS[:2], params):
        assert out.finish_reason == "stop" and len(out.token_ids) < 32, out.text
        assert out.token_ids[-1] == llm.tokenizer.eos_token_id
    choice_out, regex_out = llm.generate(PROMPTS[:2], params)
    assert choice_out.text in ("yes", "no") and re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", regex_out.text)
    plain = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(plain.token_ids) == 12 and plain.finish_reason == "length"  # unstructured: past EOS


def test_a_structured_request_never_changes_its_neighbours(llm: LLM) -> None:
    """Same batch shape, the middle request with and without a grammar: the others' tokens are equal."""
    free = llm.generate(PROMPTS, [greedy(24), greedy(24), greedy(24)])
    constrained = llm.generate(PROMPTS, [greedy(24), greedy(24, ("json_object", "")), greedy(24)])
    assert [o.token_ids for o in (free[0], free[2])] == [
        o.token_ids for o in (constrained[0], constrained[2])
    ]
    assert constrained[1].token_ids != free[1].token_ids
    assert constrained[1].text.startswith("{")


def test_mtp_on_gives_the_same_structured_output(llm: LLM, llm_mtp: LLM) -> None:
    """Greedy: verification under the grammar's masks accepts exactly the tokens decoding without drafts
    picks, so MTP on and off agree token for token; so does the asynchronous loop (placeholder drafts,
    grammar advanced on the step worker)."""
    params = [greedy(48, ("json_schema", json.dumps(SCHEMA))), greedy(24), greedy(20, ("regex", "[0-9]+"))]
    off = llm.generate(PROMPTS, params)
    on = llm_mtp.generate(PROMPTS, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    pipelined = llm_mtp.replace_config(async_scheduling=True)
    assert [o.token_ids for o in pipelined.generate(PROMPTS, params)] == [o.token_ids for o in off]
    llm_mtp.generate(["x"], [greedy(1)])  # its step lists the finished requests: their grammars dropped
    assert llm_mtp.engine.executor.structured_outputs.num_tracked_requests == 0


def test_a_draft_outside_the_grammar_is_rejected() -> None:
    tokenizer = Tokenizer.from_dir(bundled_checkpoint_dir())
    vocab_size = tokenizer.vocab_size
    structured = StructuredOutputs(tokenizer, vocab_size)
    params = SamplingParams(temperature=0, max_tokens=8, structured_output=("regex", "ab"))
    request = Request("r", [5, 6], params)
    a, b, z = (tokenizer.encode(c)[0] for c in "abz")
    logits = torch.zeros(3, vocab_size)
    logits[:, z] = 10.0  # the unconstrained argmax everywhere is "z"
    logits[0, a] = logits[1, b] = 5.0
    item = ScheduledRequest(request, 2, 3, [a, z], [0], True)  # drafts "a" (in the grammar), "z" (not)
    assert structured.mask_logits([item], logits) == {}
    assert logits[1, z] == float("-inf") and logits[0, z] == float("-inf")
    result = greedy_verify_batch(torch.tensor([a, z]), [2], logits)
    assert result.token_ids() == [[a, b]]  # "a" accepted, "z" rejected, "b" recovered
    structured.accept([item], {"r": [a, b]})
    eos_row = torch.zeros(1, vocab_size)
    structured.mask_logits([ScheduledRequest(request, 4, 1, [], [0], True)], eos_row)
    assert (eos_row[0] == 0).nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # complete: only EOS


def test_a_grammar_that_does_not_compile_is_refused(llm: LLM) -> None:
    with pytest.raises(GrammarError, match=r"^regex does not compile: .*parenthesis"):
        llm.engine.add_request("x", greedy(4, ("regex", "(ab")))
    with pytest.raises(ValueError, match="structured_output kind must be one of"):
        greedy(4, ("yaml", "{}"))


def test_running_out_of_max_tokens_is_length_never_complete(llm: LLM) -> None:
    (out,) = llm.generate(PROMPTS[:1], [greedy(5, ("json_schema", json.dumps(SCHEMA)))])
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_a_grammar_that_must_end_overrides_min_tokens(llm: LLM) -> None:
    """min_tokens bans EOS, the finished grammar allows only EOS: the grammar wins (EOS, "stop"), never a
    token the grammar refuses; a plain request beside it is unchanged."""
    choice = SamplingParams(
        temperature=0, max_tokens=8, min_tokens=6, structured_output=("choice", '["yes"]')
    )
    plain = greedy(8)
    out, beside = llm.generate(PROMPTS[:2], [choice, plain])
    assert out.text == "yes" and out.finish_reason == "stop"
    assert (
        out.token_ids[-1] == llm.tokenizer.eos_token_id and llm.tokenizer.decode(out.token_ids[:-1]) == "yes"
    )
    assert beside.token_ids == llm.generate(PROMPTS[1:2], plain)[0].token_ids


def test_mtp_drafts_of_a_structured_request_lie_in_its_grammar(llm_mtp: LLM) -> None:
    """The drafter picks among the tokens the grammar allows (greedy and sampled): every draft verification
    sees is one the request's matcher accepts after its committed tokens and earlier drafts."""
    outputs = llm_mtp.engine.executor.structured_outputs
    seen: list[bool] = []

    def fill_masks(item: ScheduledRequest, bitmask: torch.Tensor, offset: int) -> None:
        matcher = outputs._matcher(item)
        advanced = 0
        for draft in item.spec_token_ids:
            if matcher.is_terminated():
                break
            seen.append(matcher.accept_token(draft))
            advanced += seen[-1]
            if not seen[-1]:
                break
        if advanced:
            matcher.rollback(advanced)
        original(item, bitmask, offset)

    original = outputs._fill_masks
    outputs._fill_masks = fill_masks
    try:
        params = [
            greedy(32, ("regex", r"[a-z ]+")),
            SamplingParams(temperature=1.0, seed=5, max_tokens=32, structured_output=("regex", r"[0-9,]+")),
            greedy(24, ("json_schema", json.dumps(SCHEMA))),
        ]
        llm_mtp.generate(PROMPTS, params)
    finally:
        del outputs._fill_masks
    assert len(seen) > 20 and all(seen)


def test_draft_masks_mask_each_depth_and_roll_back() -> None:
    tokenizer = Tokenizer.from_dir(bundled_checkpoint_dir())
    vocab_size = tokenizer.vocab_size
    structured = StructuredOutputs(tokenizer, vocab_size)
    params = SamplingParams(temperature=0, max_tokens=8, structured_output=("regex", "ab"))
    item = ScheduledRequest(Request("r", [5, 6], params), 2, 1, [], [0], True)
    committed = torch.zeros(1, vocab_size)
    structured.mask_logits([item], committed)  # creates the matcher
    allowed = (committed[0] == 0).nonzero().flatten().tolist()  # "a", and "ab" where it is one token
    a, b = (tokenizer.encode(c)[0] for c in "ab")
    assert a in allowed and b not in allowed
    masks = structured.draft_masks(["plain", "r"])
    assert masks is not None and structured.draft_masks(["plain"]) is None
    first = torch.zeros(2, vocab_size)
    masks.mask_(first, [0, 1], None)
    assert (first[0] == 0).all() and (first[1] == 0).nonzero().flatten().tolist() == allowed
    second = torch.zeros(1, vocab_size)
    masks.mask_(second, [1], torch.tensor([a]))  # work 1 drafted "a" at the first depth
    assert (second[0] == 0).nonzero().flatten().tolist() == [b]
    masks.finish()
    again = torch.zeros(1, vocab_size)
    structured.mask_logits([item], again)  # rolled back: "a" is next again
    assert (again[0] == 0).nonzero().flatten().tolist() == allowed
