"""The pure dispatch policy (`driver.dispatch`): every decision `Cluster.generate` takes for an
attempt's events, and the reserve back-pressure rule, on plain data (no Ray, no event loop)."""

from __future__ import annotations

import dataclasses

import pytest

from pdcluster.driver.dispatch import (
    CALL_TIMEOUT_MIN_S,
    EVENT_SLACK_S,
    RESERVE_RETRY_S,
    AttemptState,
    Emit,
    EndAborted,
    Fail,
    NoEvent,
    PrefillDone,
    Prefilled,
    PrefillFailed,
    PrefillSampled,
    Redispatch,
    ReserveOutcome,
    RetryReserve,
    RouteAgain,
    StartPrefill,
    Wait,
    after_reserve,
    call_timeout_s,
    event_timeout_s,
    next_action,
)
from pdcluster.driver.messages import (
    Aborted,
    DecodeLost,
    Phases,
    PrefillFirstToken,
    PrefillResult,
    RequestError,
    TokenDelta,
)

FIRST = AttemptState("r1", attempt_index=0, prefill_instance=0, decode_instance=1, event_timeout_s=35.0)


def test_the_first_token_delta_is_emitted_as_it_came() -> None:
    delta = TokenDelta("r1@0", (42,), kv_transfer_bytes=4096)
    assert next_action(FIRST, delta) == Emit(delta)
    last = TokenDelta("r1@0", (7, 8), finished=True, finish_reason="length")
    assert next_action(FIRST, last) == Emit(last)


def test_a_returned_prefill_call_is_waited_on() -> None:
    """The prefill call's last reply (its KV went to the sender) only brings phases."""
    result = PrefillResult(first_token_id=42, num_drafts=1, queue_s=0.25, prefill_s=1.5)
    assert next_action(FIRST, PrefillDone(result)) == Wait(result)


def test_a_prefill_reply_streams_its_first_token_unless_the_client_has_one() -> None:
    """The prefill call's first reply (its token just sampled) streams the token, unless its text is
    decode's to stream or the client has a first token already."""
    first = PrefillFirstToken(42, " the", queue_s=0.25)
    assert next_action(FIRST, PrefillSampled(first)) == Prefilled(first, emit=True)
    streamed = AttemptState("r1", 0, 0, 1, first_token_streamed=True)  # a re-dispatch after it streamed
    assert next_action(streamed, PrefillSampled(first)) == Prefilled(first, emit=False)
    decodes = PrefillFirstToken(42, None, queue_s=0.25)  # stop strings / logprobs: decode streams it
    assert next_action(FIRST, PrefillSampled(decodes)) == Prefilled(decodes, emit=False)
    # an incomplete character streams no text yet, but the token goes
    partial = PrefillFirstToken(42, "")
    assert next_action(FIRST, PrefillSampled(partial)) == Prefilled(partial, emit=True)


def test_prefill_died_before_any_token_is_redispatched_to_another_prefill() -> None:
    action = next_action(FIRST, PrefillFailed("the actor process died"))
    assert action == Redispatch(
        excluded_prefill=0, error="attempt 1 (prefill-0 -> decode-1): prefill-0: the actor process died"
    )


def test_prefill_died_before_decodes_reservation_routes_again() -> None:
    """A prefill instance lost in the load round (before any reservation): route again at once over the
    instances still in routing, deadline or not (it is out of routing now)."""
    assert after_reserve("r1", ReserveOutcome.INSTANCE_LOST, now_s=99.0, deadline_s=10.0) == RouteAgain()


def test_prefill_died_after_decodes_reservation_the_transfer_fails_on_decode() -> None:
    """The prefill died once decode reserved: decode's wait for the handoff fails (sender lost) and it
    reports an error before any token: re-dispatched."""
    action = next_action(FIRST, RequestError("r1@0", "TransferAborted: sender lost"))
    assert action == Redispatch(0, "attempt 1 (prefill-0 -> decode-1): TransferAborted: sender lost")


def test_transfer_failed_with_tokens_already_sent_fails_mid_stream() -> None:
    state = AttemptState("r1", 0, 0, 1, decode_streamed=True)
    action = next_action(state, RequestError("r1@0", "decode failed: boom"))
    assert action == Fail("r1: decode failed mid-stream: decode failed: boom")


def test_transfer_failed_after_only_prefills_first_token_is_redispatched() -> None:
    """The first token went to the client from the prefill reply, decode streamed nothing: re-dispatched
    (`Cluster.generate` keeps that token: `PrefillRequest.first_token_id`)."""
    state = AttemptState("r1", 0, 0, 1, first_token_streamed=True)
    action = next_action(state, RequestError("r1@0", "checksum mismatch"))
    assert action == Redispatch(0, "attempt 1 (prefill-0 -> decode-1): checksum mismatch")


def test_with_no_other_prefill_a_decode_side_failure_retries_on_the_same_prefill() -> None:
    """A one-prefill pool: the transfer or the admission failed on decode, the prefill instance is still in
    routing: re-dispatched with no prefill excluded (it serves the retry)."""
    state = AttemptState("r1", 0, 0, 1, num_other_prefills=0)
    action = next_action(state, RequestError("r1@0", "LeaseExpired: no layer in 30 s"))
    assert action == Redispatch(None, "attempt 1 (prefill-0 -> decode-1): LeaseExpired: no layer in 30 s")
    assert next_action(state, NoEvent()) == Redispatch(
        None, "attempt 1 (prefill-0 -> decode-1): no event from decode-1 / prefill-0 within 0 s"
    )


def test_with_no_other_prefill_a_failed_prefill_fails_naming_the_cause() -> None:
    state = AttemptState("r1", 0, 0, 1, num_other_prefills=0)
    assert next_action(state, PrefillFailed("the actor process died")) == Fail(
        "r1: KV handoff failed: attempt 1 (prefill-0 -> decode-1): prefill-0: the actor process died; "
        "no other live prefill instance to re-dispatch to"
    )
    gone = AttemptState("r1", 0, 0, 1, num_other_prefills=0, prefill_routable=False)
    action = next_action(gone, RequestError("r1@0", "LeaseExpired: no layer in 30 s"))
    assert action == Fail(
        "r1: KV handoff failed: attempt 1 (prefill-0 -> decode-1): LeaseExpired: no layer in 30 s; "
        "no other live prefill instance to re-dispatch to"
    )


def test_the_second_failed_attempt_fails_with_both_causes() -> None:
    earlier = "attempt 1 (prefill-0 -> decode-1): prefill-0: the actor process died"
    state = AttemptState("r1", 1, 2, 1, earlier_errors=(earlier,), num_other_prefills=5)
    action = next_action(state, RequestError("r1@1", "checksum mismatch"))
    assert action == Fail(
        f"r1: KV handoff failed: {earlier}; attempt 2 (prefill-2 -> decode-1): checksum mismatch"
    )


def test_decode_died_fails_a_request_that_cannot_be_re_dispatched() -> None:
    """(`test_recompute_policy`: the requests that can are re-dispatched.)"""
    lost = DecodeLost("r1@0", "decode-1 died or stopped answering (poll: the actor process died); lost")
    refused = dataclasses.replace(FIRST, recompute_refusal="the client aborted it")
    assert next_action(refused, lost) == Fail(
        "r1: decode-1 died or stopped answering (poll: the actor process died); lost; "
        "not re-dispatched: the client aborted it"
    )
    # an error that comes while decode is out of routing: what it held is gone too
    down = AttemptState(
        "r1", 0, 0, 1, decode_down_reason="poll: no answer within 2 s", recompute_refusal="it had finished"
    )
    assert next_action(down, RequestError("r1@0", "KeyError: r1@0")) == Fail(
        "r1: decode-1 died or stopped answering (poll: no answer within 2 s); the request was lost "
        "(KeyError: r1@0); not re-dispatched: it had finished"
    )


def test_abort_ends_the_stream_never_redispatched() -> None:
    assert next_action(FIRST, Aborted("r1@0")) == EndAborted()
    assert after_reserve("r1", ReserveOutcome.ABORTED, now_s=0.0, deadline_s=10.0) == EndAborted()


def test_no_event_within_the_event_timeout() -> None:
    assert next_action(FIRST, NoEvent()) == Redispatch(
        0, "attempt 1 (prefill-0 -> decode-1): no event from decode-1 / prefill-0 within 35 s"
    )
    mid_stream = AttemptState("r1", 0, 0, 1, decode_streamed=True, event_timeout_s=35.0)
    assert next_action(mid_stream, NoEvent()) == Fail(
        "r1: decode failed mid-stream: no event from decode-1 / prefill-0 within 35 s"
    )


def test_reserve_back_pressure_retries_until_the_deadline() -> None:
    assert after_reserve("r1", ReserveOutcome.BOUND, now_s=5.0, deadline_s=10.0) == StartPrefill()
    assert after_reserve("r1", ReserveOutcome.NO_ROOM, now_s=5.0, deadline_s=10.0) == RetryReserve(0.05)
    assert RESERVE_RETRY_S == 0.05
    assert after_reserve("r1", ReserveOutcome.NO_ROOM, now_s=10.0, deadline_s=10.0) == RetryReserve(0.05)
    assert after_reserve("r1", ReserveOutcome.NO_ROOM, now_s=10.01, deadline_s=10.0) == Fail(
        "r1: no decode instance had KV blocks free in time"
    )


def test_the_timeouts_derive_from_the_kv_transfer_timeout() -> None:
    assert call_timeout_s(30.0) == 15.0
    assert call_timeout_s(1.0) == CALL_TIMEOUT_MIN_S == 2.0
    assert event_timeout_s(30.0) == 30.0 + EVENT_SLACK_S == 35.0


def test_an_unknown_event_is_refused() -> None:
    with pytest.raises(TypeError, match="not an attempt event"):
        next_action(FIRST, "abort")  # type: ignore[arg-type]  # a positional tuple of old


def test_phases_merge_and_the_reported_phases_keep_bytes_apart_from_seconds() -> None:
    from pdcluster.driver.backend import StreamDelta

    prefill = Phases(queue_s=0.5, prefill_s=1.0)
    decode = Phases(kv_transfer_s=0.25, first_decode_step_s=None)
    merged = prefill.merged(decode).merged(Phases(queue_s=0.75))  # a later measure replaces an earlier
    assert merged == Phases(queue_s=0.75, prefill_s=1.0, kv_transfer_s=0.25)
    assert merged.as_dict() == {"queue_s": 0.75, "prefill_s": 1.0, "kv_transfer_s": 0.25}
    delta = StreamDelta([1], phases=merged.as_dict(), kv_transfer_bytes=4096)
    assert delta.reported_phases() == {**merged.as_dict(), "kv_transfer_bytes": 4096}
    assert StreamDelta([1], phases={"total_s": 2.0}).reported_phases() == {"total_s": 2.0}
