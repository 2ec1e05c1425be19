"""Which requests a lost decode instance's KV re-dispatches with their streamed tokens kept
(`driver.recompute`, `driver.dispatch.next_action`), which fail and with which message, and what the
re-dispatch sends: pure data, no Ray, no event loop."""

from __future__ import annotations

import dataclasses

import pytest

from pdcluster.driver.dispatch import AttemptState, Fail, NoEvent, next_action
from pdcluster.driver.messages import DecodeLost, RequestError, TokenDelta
from pdcluster.driver.recompute import MAX_RECOMPUTES, Recompute, recompute_refusal, resume
from pdcluster.driver.request_state import DriverRequest
from pdcluster.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LOST = "decode-1 died or stopped answering (elastic: rank 1 lost); the request was lost"


def test_a_lost_decode_re_dispatches_a_request_that_can_be_continued() -> None:
    state = AttemptState("r1", 0, 0, 1, decode_streamed=True, recompute_refusal=None)
    assert next_action(state, DecodeLost("r1@0", LOST)) == Recompute(LOST)
    # an error or silence while decode is out of routing: its KV is gone too
    down = dataclasses.replace(state, decode_down_reason="poll: the actor process died")
    assert next_action(down, RequestError("r1@0", "KeyError: r1@0")) == Recompute(
        "decode-1 died or stopped answering (poll: the actor process died); the request was lost "
        "(KeyError: r1@0)"
    )
    assert isinstance(next_action(down, NoEvent()), Recompute)
    # decode in routing and failing mid-stream: not a lost KV, no re-dispatch
    assert next_action(state, NoEvent()) == Fail(
        "r1: decode failed mid-stream: no event from decode-1 / prefill-0 within 0 s"
    )


def test_a_lost_decode_fails_a_request_that_cannot_be_continued_naming_why() -> None:
    why = recompute_refusal(GREEDY, num_recomputes=MAX_RECOMPUTES)
    state = AttemptState("r1", 1, 0, 1, recompute_refusal=why)
    assert next_action(state, DecodeLost("r1@1", LOST)) == Fail(
        f"r1: {LOST}; not re-dispatched: it was re-dispatched after a lost decode 1 time(s), the most allowed"
    )


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (GREEDY, None),
        (SamplingParams(temperature=0.0, seed=7, max_tokens=8), None),  # greedy: the seed draws nothing
        (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8), None),  # unseeded: drawn afresh
        (
            SamplingParams(temperature=0.8, seed=7, max_tokens=8),
            "its seeded sampling stream cannot be continued on another instance",
        ),
        (
            SamplingParams(temperature=0.0, structured_output=("json_object", ""), max_tokens=8),
            "its structured-output grammar state cannot be carried over",
        ),
        (
            SamplingParams(temperature=0.0, stop=("\n",), max_tokens=8),
            "its stop strings are matched on decode's text, which a re-dispatch would restart",
        ),
        (
            SamplingParams(temperature=0.0, logprobs=0, max_tokens=8),
            "it asks for logprobs, which the carried-over token has none of",
        ),
        (
            SamplingParams(temperature=0.0, frequency_penalty=0.5, max_tokens=8),
            "its penalties / min_tokens count output tokens, which a re-dispatch moves into the prompt",
        ),
        (
            SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8),
            "its penalties / min_tokens count output tokens, which a re-dispatch moves into the prompt",
        ),
    ],
)
def test_which_sampling_state_can_be_continued(params: SamplingParams, why: str | None) -> None:
    assert recompute_refusal(params, num_recomputes=0) == why


def test_a_finished_or_aborted_request_is_never_re_dispatched() -> None:
    assert recompute_refusal(GREEDY, 0, finished=True) == "it had finished"
    assert recompute_refusal(GREEDY, 0, aborted=True) == "the client aborted it"
    assert recompute_refusal(GREEDY, 1, max_recomputes=2) is None  # the bound is a parameter


def test_the_re_dispatch_keeps_the_streamed_tokens() -> None:
    """Prompt + streamed[:-1] is prefilled, streamed[-1] forced as its first token; max_tokens drops by
    the tokens moved into the prompt, so the request still ends after max_tokens tokens in all."""
    resumed = resume([1, 2, 3], GREEDY, [10, 11, 12])
    assert resumed.prompt_token_ids == [1, 2, 3, 10, 11]
    assert (resumed.params.max_tokens, resumed.first_token_id, resumed.num_recomputed_tokens) == (6, 12, 3)
    assert dataclasses.replace(resumed.params, max_tokens=8) == GREEDY
    nothing = resume([1, 2, 3], GREEDY, [])
    assert (nothing.prompt_token_ids, nothing.params, nothing.first_token_id) == ([1, 2, 3], GREEDY, None)
    with pytest.raises(ValueError, match="8 tokens streamed of max_tokens=8"):
        resume([1], GREEDY, list(range(8)))


def test_the_client_sees_one_stream_and_the_phases_say_what_was_recomputed() -> None:
    record = DriverRequest("r1", arrival_s=0.0)
    record.first_token = (10, "a")
    assert (
        record.stream_delta(TokenDelta("r1@0", (10,), new_text="a")).phases.get("recomputed_tokens") is None
    )
    record.stream_delta(TokenDelta("r1@0", (11, 12), new_text="bc"))
    record.decode_streamed = True
    resumed = record.recompute(LOST, [1, 2, 3], GREEDY)
    assert (record.first_token, record.num_recomputes, record.lost) == ((12, ""), 1, LOST)
    assert record.decode_streamed is False  # the re-dispatch may take a handoff retry of its own
    assert resumed.prompt_token_ids == [1, 2, 3, 10, 11]
    # the forced token is not streamed again: decode's first delta of the new attempt starts after it
    delta = record.stream_delta(TokenDelta("r1@1", (13,), finished=True, finish_reason="length"))
    assert delta.phases["recomputed_tokens"] == 3
    assert record.streamed_token_ids == [10, 11, 12, 13]
