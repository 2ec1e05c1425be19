"""The dispatch policy of one request: pure functions over plain data (no Ray, no asyncio, no clock)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdcluster.driver.messages import (
    Aborted,
    DecodeLost,
    PrefillFirstToken,
    PrefillResult,
    RequestError,
    TokenDelta,
)
from pdcluster.driver.recompute import Recompute

MAX_DISPATCH_ATTEMPTS = 2  # the first try plus one re-dispatch to another prefill instance
CALL_TIMEOUT_MIN_S = 2.0  # floor of the per-call timeout (max(this, kv_transfer.timeout_s / 2))
EVENT_SLACK_S = 5.0  # a prefill call / a wait for the next event gives up after kv_transfer.timeout_s + this
RESERVE_RETRY_S = 0.05  # while no decode instance has room, the reserve is retried this often (seconds)
POLL_WAIT_S = 0.05  # a decode poll returns after this long without events (its call may take that much more)


def call_timeout_s(kv_timeout_s: float) -> float:
    """Seconds one actor call on the request path (load, reserve, abort, poll) may take."""
    return max(CALL_TIMEOUT_MIN_S, kv_timeout_s / 2)


def collective_timeout_s(kv_timeout_s: float) -> float:
    """Seconds one collective of an instance group (`driver.instance_group`) may wait: the handoff's lease."""
    return kv_timeout_s


def event_timeout_s(kv_timeout_s: float) -> float:
    """Seconds the prefill call (queue + prompt + handoff) and each wait for a request's next event may
    take: the handoff's lease plus EVENT_SLACK_S."""
    return kv_timeout_s + EVENT_SLACK_S


# ---- reserve back-pressure ----------------------------------------------------------------------------
class ReserveOutcome(enum.Enum):
    BOUND = "bound"  # decode reserved blocks and bound the handoff
    NO_ROOM = "no_room"  # decode has no room right now
    INSTANCE_LOST = "instance_lost"  # a load or reserve call found an instance dead or unresponsive
    ABORTED = "aborted"  # the request was aborted meanwhile


@dataclass(frozen=True)
class StartPrefill:
    """The reservation is bound: call prefill."""


@dataclass(frozen=True)
class RouteAgain:
    """Route again at once over the instances still in routing (the lost one is out of routing)."""


@dataclass(frozen=True)
class RetryReserve:
    """Back-pressure: route and reserve again after `delay_s` seconds."""

    delay_s: float


@dataclass(frozen=True)
class EndAborted:
    """End the stream with an empty delta, finish_reason "abort" (never re-dispatched)."""


@dataclass(frozen=True)
class Fail:
    """Fail the request with `BackendUnavailable(message)`."""

    message: str


def after_reserve(
    request_id: str, outcome: ReserveOutcome, now_s: float, deadline_s: float
) -> StartPrefill | RouteAgain | RetryReserve | EndAborted | Fail:
    """What to do after one route + reserve round of `request_id` (times in seconds, one clock).
    No room past `deadline_s` fails the request; before it, the reserve is retried every RESERVE_RETRY_S."""
    if outcome is ReserveOutcome.ABORTED:
        return EndAborted()
    if outcome is ReserveOutcome.BOUND:
        return StartPrefill()
    if outcome is ReserveOutcome.INSTANCE_LOST:
        return RouteAgain()
    if now_s > deadline_s:
        return Fail(f"{request_id}: no decode instance had KV blocks free in time")
    return RetryReserve(RESERVE_RETRY_S)


# ---- one attempt's events -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AttemptState:
    """One dispatch attempt of a request, as plain data."""

    request_id: str
    attempt_index: int
    prefill_instance: int
    decode_instance: int
    decode_streamed: bool = False
    first_token_streamed: bool = False
    earlier_errors: tuple[str, ...] = ()
    decode_down_reason: str | None = None
    num_other_prefills: int = 1
    prefill_routable: bool = True
    event_timeout_s: float = 0.0
    max_attempts: int = MAX_DISPATCH_ATTEMPTS
    recompute_refusal: str | None = None  # why a lost decode's request cannot be re-dispatched (None: can)


@dataclass(frozen=True)
class PrefillFailed:
    """The attempt's prefill call raised or timed out; `message` describes it (one line). `reforming`: its
    multi-rank instance lost a rank and re-forms (`driver.elastic_requests.reforming`): not excluded."""

    message: str
    reforming: bool = False


@dataclass(frozen=True)
class PrefillSampled:
    """The attempt's prefill call's first reply: its first token was sampled."""

    first: PrefillFirstToken


@dataclass(frozen=True)
class PrefillDone:
    """The attempt's prefill call returned its last reply."""

    result: PrefillResult


@dataclass(frozen=True)
class NoEvent:
    """Nothing happened within `event_timeout_s`."""


@dataclass(frozen=True)
class Emit:
    """Stream `delta` to the client (the last one when `delta.finished`)."""

    delta: TokenDelta


@dataclass(frozen=True)
class Wait:
    """Nothing for the client: record the prefill's phases and wait for the next event."""

    phases_from: PrefillResult


@dataclass(frozen=True)
class Prefilled:
    """The handoff is prefilled. `emit`: stream its first token now, before decode admits the request;
    otherwise the client has it already, or decode streams it."""

    first: PrefillFirstToken
    emit: bool


@dataclass(frozen=True)
class Redispatch:
    """Release this attempt and dispatch again to a prefill instance other than `excluded_prefill` (None:
    any); `error` is this attempt's line (`describe_attempt`), kept for the final message."""

    excluded_prefill: int | None
    error: str


Event = (
    TokenDelta | RequestError | Aborted | DecodeLost | PrefillFailed | PrefillSampled | PrefillDone | NoEvent
)
Action = Emit | Prefilled | Wait | EndAborted | Redispatch | Recompute | Fail


def describe_attempt(state: AttemptState, error: str) -> str:
    """`attempt 1 (prefill-0 -> decode-1): <error>`."""
    return (
        f"attempt {state.attempt_index + 1} (prefill-{state.prefill_instance} -> "
        f"decode-{state.decode_instance}): {error}"
    )


def next_action(state: AttemptState, event: Event) -> Action:
    """The action for `event` of the attempt `state`."""
    if isinstance(event, TokenDelta):
        return Emit(event)
    if isinstance(event, PrefillSampled):
        emit = event.first.first_token_text is not None and not state.first_token_streamed
        return Prefilled(event.first, emit)
    if isinstance(event, PrefillDone):
        return Wait(event.result)
    if isinstance(event, Aborted):
        return EndAborted()
    if isinstance(event, DecodeLost):
        return _decode_lost(state, event.message)
    if isinstance(event, PrefillFailed):
        error = f"prefill-{state.prefill_instance}: {event.message}"
    elif isinstance(event, RequestError):
        error = event.message
    elif isinstance(event, NoEvent):
        error = (
            f"no event from decode-{state.decode_instance} / prefill-{state.prefill_instance} "
            f"within {state.event_timeout_s:.0f} s"
        )
    else:
        raise TypeError(f"not an attempt event: {event!r}")
    if state.decode_down_reason is not None:
        return _decode_lost(
            state,
            f"decode-{state.decode_instance} died or stopped answering ({state.decode_down_reason}); "
            f"the request was lost ({error})",
        )
    if state.decode_streamed:
        return Fail(f"{state.request_id}: decode failed mid-stream: {error}")
    errors = (*state.earlier_errors, describe_attempt(state, error))
    handoff_failed = f"{state.request_id}: KV handoff failed: {'; '.join(errors)}"
    if state.attempt_index + 1 >= state.max_attempts:
        return Fail(handoff_failed)
    if isinstance(event, PrefillFailed) and event.reforming:
        return Redispatch(None, f"{errors[-1]}; re-dispatched, its instance re-forming on its other ranks")
    if state.num_other_prefills > 0:
        return Redispatch(state.prefill_instance, errors[-1])
    if isinstance(event, PrefillFailed) or not state.prefill_routable:
        return Fail(f"{handoff_failed}; no other live prefill instance to re-dispatch to")
    # Decode's side failed or nothing came, and prefill is still in routing: it may serve the retry.
    return Redispatch(None, errors[-1])


def _decode_lost(state: AttemptState, message: str) -> Recompute | Fail:
    """The attempt's decode instance lost the request's KV: re-dispatch it (`driver.recompute`) or fail."""
    if state.recompute_refusal is None:
        return Recompute(message)
    return Fail(f"{state.request_id}: {message}; not re-dispatched: {state.recompute_refusal}")
