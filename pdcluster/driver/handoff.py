"""The P->D handoff of one dispatch attempt, as the driver owns it: a pure state machine."""

from __future__ import annotations

import enum


class HandoffState(enum.Enum):
    ROUTED = "routed"
    RESERVED = "reserved"
    BOUND = "bound"
    PREFILLED = "prefilled"
    TRANSFERRED = "transferred"
    ADMITTED = "admitted"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class HandoffEvent(enum.Enum):
    RESERVED = "reserved"
    REROUTED = "rerouted"
    BOUND = "bound"
    PREFILLED = "prefilled"
    TRANSFERRED = "transferred"
    ADMITTED = "admitted"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


class IllegalTransition(ValueError):
    """An event the handoff cannot take in its state (a protocol bug, never a client's error)."""


S, E = HandoffState, HandoffEvent
FINAL_STATES = frozenset({S.DONE, S.FAILED, S.ABORTED})
LIVE_STATES = frozenset(S) - FINAL_STATES

TRANSITIONS: dict[tuple[HandoffState, HandoffEvent], HandoffState] = {
    (S.ROUTED, E.RESERVED): S.RESERVED,
    (S.ROUTED, E.REROUTED): S.ROUTED,
    (S.RESERVED, E.BOUND): S.BOUND,
    (S.BOUND, E.PREFILLED): S.PREFILLED,
    (S.PREFILLED, E.TRANSFERRED): S.TRANSFERRED,
    (S.TRANSFERRED, E.ADMITTED): S.ADMITTED,
    (S.ADMITTED, E.FINISHED): S.DONE,
    **{(state, E.FAILED): S.FAILED for state in LIVE_STATES},
    **{(state, E.ABORTED): S.ABORTED for state in LIVE_STATES},
}


def advance(state: HandoffState, event: HandoffEvent) -> HandoffState:
    """The handoff's state after `event`. Raises `IllegalTransition` for a pair not in TRANSITIONS."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"handoff in state {state.value} cannot take {event.value}") from None


def decode_has_it(state: HandoffState) -> bool:
    """Decode received the handoff's KV (its first delta of the attempt was taken)."""
    return state in (S.TRANSFERRED, S.ADMITTED, S.DONE)
