"""The stop rules (`engine.stopping`) and the streamed text delta of `RequestOutput.new_text`."""

from __future__ import annotations

import pytest

from pdcluster.engine.llm import LLM
from pdcluster.engine.request import RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.stopping import (
    OutputText,
    check_stop_token,
    early_first_token_text,
    find_stop_string,
    stop_prefix_len,
)
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts
from pdcluster.models.tokenizer import Tokenizer

CKPT = bundled_checkpoint_dir()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(CKPT)


def test_check_stop_token(make_request) -> None:
    request = make_request(max_tokens=3, eos_token_id=2, stop_token_ids=(7,))
    assert check_stop_token(request, 5, 1) is RequestStatus.RUNNING
    assert check_stop_token(request, 2, 1) is RequestStatus.FINISHED_STOPPED and request.stop_reason is None
    assert check_stop_token(request, 7, 1) is RequestStatus.FINISHED_STOPPED and request.stop_reason == 7
    assert check_stop_token(request, 5, 3) is RequestStatus.FINISHED_LENGTH
    ignoring = make_request(max_tokens=3, eos_token_id=2, ignore_eos=True)
    assert check_stop_token(ignoring, 2, 1) is RequestStatus.RUNNING


def test_the_first_token_goes_early_only_when_decode_would_stream_it_unchanged(tokenizer: Tokenizer) -> None:
    """`early_first_token_text`: the text decode's first output streams for the token (an incomplete
    character streams nothing yet), or None where decode may hold it back or cut it (stop strings) or
    reports more than the token (logprobs, prompt logprobs)."""
    plain = SamplingParams(max_tokens=8)
    (the,) = tokenizer.encode(" the")
    assert early_first_token_text(tokenizer, plain, the) == " the"
    partial = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).endswith("\ufffd"))
    assert early_first_token_text(tokenizer, plain, partial) == ""
    assert early_first_token_text(tokenizer, SamplingParams(max_tokens=8, stop=("x",)), the) is None
    assert early_first_token_text(tokenizer, SamplingParams(max_tokens=8, logprobs=2), the) is None
    assert early_first_token_text(tokenizer, SamplingParams(max_tokens=8, prompt_logprobs=0), the) is None
    # a token that finishes the request goes too: decode's final text for it starts with this one
    assert early_first_token_text(tokenizer, SamplingParams(max_tokens=1), the) == " the"
    assert early_first_token_text(tokenizer, plain, tokenizer.eos_token_id) == ""


def test_find_stop_string_and_stop_prefix_len() -> None:
    assert find_stop_string("a cat sat", ("sat", "cat")) == 2
    assert find_stop_string("a cat", ("dog",)) is None
    assert stop_prefix_len("the en", ("end", "n!")) == 2  # "en" could start "end"
    assert stop_prefix_len("the e", ("end",)) == 1
    assert stop_prefix_len("the end", ("xyz",)) == 0
    assert stop_prefix_len("abc", ()) == 0


def _stream(
    tokenizer: Tokenizer, token_ids: list[int], stop: tuple[str, ...]
) -> tuple[list[str], OutputText]:
    """Feed `token_ids` one at a time, as a request's steps would; the last update is final."""
    text = OutputText(tokenizer, stop)
    deltas = []
    for n in range(1, len(token_ids) + 1):
        stopped = text.update(token_ids[:n], final=n == len(token_ids))
        finished = stopped or n == len(token_ids)
        deltas.append(text.new_text(finished))
        if stopped:
            break
    return deltas, text


def test_deltas_concatenate_to_the_text_and_never_split_a_character(tokenizer) -> None:
    source = "naïve café — 世界 ünïcödé 😀 end"
    token_ids = tokenizer.encode(source)
    deltas, text = _stream(tokenizer, token_ids, ())
    assert "".join(deltas) == text.text == tokenizer.decode(token_ids)
    assert all("\ufffd" not in d for d in deltas)
    # the byte-level tokenizer splits some of these characters across tokens: some step adds no text
    assert "" in deltas


def test_a_stop_string_across_tokens_is_held_back_and_cut(tokenizer) -> None:
    source = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))"
    token_ids = tokenizer.encode(source)
    deltas, text = _stream(tokenizer, token_ids, ("\n\n", "retu"))
    assert text.stopped and text.text == "def add(a, b):\n    "
    assert "".join(deltas) == text.text  # no part of "retu" was ever streamed
    assert all("r" not in d for d in deltas)
    assert text.update(token_ids, final=True) is True and text.text == "def add(a, b):\n    "  # no change


def test_engine_new_text_streams_the_final_text_with_stop_strings() -> None:
    """Greedy requests with and without a stop string: each request's `new_text` deltas over its outputs
    concatenate to its final `text`, which is the detokenized output cut before the first stop string."""
    llm = LLM(CKPT, num_kv_blocks=128, block_size=16)
    engine, prompts = llm.engine, heldout_def_prompts(3)
    free_run = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    stop = free_run[1].text[5:8]  # occurs in request 1's output: it stops there
    assert len(stop) == 3, free_run[1].text
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,) if i == 1 else ()) for i in range(3)
    ]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    streamed = dict.fromkeys(ids, "")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.new_text
            if out.finished:
                final[out.request_id] = out
    for rid in ids:
        assert streamed[rid] == final[rid].text
    assert final[ids[0]].text == free_run[0].text and final[ids[2]].text == free_run[2].text
    full = llm.tokenizer.decode(final[ids[1]].token_ids)
    assert final[ids[1]].finish_reason == "stop" and final[ids[1]].text == full[: full.find(stop)]
    assert stop not in final[ids[1]].text and free_run[1].text.startswith(final[ids[1]].text)


def test_a_stop_string_in_the_first_token_of_a_remote_prefill_finishes_it_at_admission() -> None:
    """Decode side: the first token (sampled on the prefill instance) goes through the same stop rule;
    nothing is left to step for the request, so its output comes from `pop_finished_outputs`."""
    llm = LLM(CKPT, num_kv_blocks=32, block_size=16)
    engine = llm.engine
    first_token = engine.tokenizer.encode(" return")[0]
    stop = engine.tokenizer.decode([first_token])[-2:]
    prompt = engine.tokenizer.encode("def f(x):\n   ")
    params = SamplingParams(temperature=0.0, max_tokens=8, stop=(stop,))
    assert engine.reserve_remote_prefill("r", prompt, params)
    engine.admit_remote_prefill("r", first_token)
    assert not engine.has_unfinished_requests()
    (out,) = engine.pop_finished_outputs()
    full = engine.tokenizer.decode([first_token])
    assert (out.finish_reason, out.token_ids, out.text, out.new_text) == (
        "stop",
        [first_token],
        full[: full.find(stop)],
        full[: full.find(stop)],
    )
    engine.scheduler.block_manager.check_no_leaks()
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_requests_not_streamed_report_only_their_final_output_with_the_same_text_and_stop() -> None:
    """`add_request(stream=False)`: `step` reports nothing for the request until it finishes (no text or
    output built on the step path), and then the very tokens and text a streamed twin gets, stop string
    included (still checked every step, so it stops at the same token). An aborted one gets its text."""
    llm = LLM(CKPT, num_kv_blocks=256, block_size=16)
    engine, prompts = llm.engine, heldout_def_prompts(3)
    free_run = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    stop = free_run[1].text[5:8]
    assert len(stop) == 3, free_run[1].text
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,) if i == 1 else ()) for i in range(3)
    ]
    streamed = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    quiet = [engine.add_request(p, sp, stream=False) for p, sp in zip(prompts, params, strict=True)]
    final, reports = {}, dict.fromkeys(streamed + quiet, 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports[out.request_id] += 1
            if out.finished:
                final[out.request_id] = out
    for s, q in zip(streamed, quiet, strict=True):
        assert reports[q] == 1 and reports[s] > 1
        assert (final[q].token_ids, final[q].text, final[q].finish_reason) == (
            final[s].token_ids,
            final[s].text,
            final[s].finish_reason,
        )
        assert final[q].new_text == final[q].text
    assert final[quiet[1]].finish_reason == "stop" and stop not in final[quiet[1]].text
    assert len(final[quiet[1]].token_ids) < 16

    rid = engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=16), stream=False)
    for _ in range(4):
        assert engine.step() == []
    assert engine.abort_request(rid)
    (aborted,) = engine.step()
    assert aborted.finished and len(aborted.token_ids) >= 1
    assert aborted.text == llm.tokenizer.decode(aborted.token_ids)
    assert free_run[0].text.startswith(aborted.text)
