"""The P->D handoff state machine (`driver.handoff`), by table: every (state, event) pair."""

from __future__ import annotations

import itertools

import pytest

from pdcluster.driver.handoff import (
    FINAL_STATES,
    TRANSITIONS,
    HandoffEvent,
    HandoffState,
    IllegalTransition,
    advance,
    decode_has_it,
)

S, E = HandoffState, HandoffEvent
LIVE = [s for s in S if s not in FINAL_STATES]

# Written out independently of the module's table: a served request's path, a reroute, failure or abort.
PATH = [S.ROUTED, S.RESERVED, S.BOUND, S.PREFILLED, S.TRANSFERRED, S.ADMITTED, S.DONE]
PATH_EVENTS = [E.RESERVED, E.BOUND, E.PREFILLED, E.TRANSFERRED, E.ADMITTED, E.FINISHED]
LEGAL: dict[tuple[HandoffState, HandoffEvent], HandoffState] = {
    **{(s, e): after for s, e, after in zip(PATH[:-1], PATH_EVENTS, PATH[1:], strict=True)},
    (S.ROUTED, E.REROUTED): S.ROUTED,
    **{(s, E.FAILED): S.FAILED for s in LIVE},
    **{(s, E.ABORTED): S.ABORTED for s in LIVE},
}


@pytest.mark.parametrize(("state", "event"), sorted(LEGAL, key=lambda p: (p[0].value, p[1].value)))
def test_every_legal_transition(state: HandoffState, event: HandoffEvent) -> None:
    assert advance(state, event) is LEGAL[(state, event)]


ILLEGAL = [pair for pair in itertools.product(S, E) if pair not in LEGAL]


@pytest.mark.parametrize(("state", "event"), ILLEGAL)
def test_every_illegal_transition_raises(state: HandoffState, event: HandoffEvent) -> None:
    with pytest.raises(IllegalTransition, match=f"{state.value} cannot take {event.value}"):
        advance(state, event)


def test_the_table_is_exactly_the_legal_pairs() -> None:
    assert TRANSITIONS == LEGAL
    assert len(LEGAL) + len(ILLEGAL) == len(S) * len(E)


def test_final_states_take_nothing() -> None:
    for state, event in itertools.product(FINAL_STATES, E):
        with pytest.raises(IllegalTransition):
            advance(state, event)


def test_the_paths_a_request_takes() -> None:
    """A handoff, one after a reroute, a failure, an abort."""
    paths = [
        [E.RESERVED, E.BOUND, E.PREFILLED, E.TRANSFERRED, E.ADMITTED, E.FINISHED],
        [E.REROUTED, E.RESERVED, E.BOUND, E.PREFILLED, E.TRANSFERRED, E.ADMITTED, E.FINISHED],
        [E.RESERVED, E.BOUND, E.FAILED],
        [E.ABORTED],
    ]
    ends = []
    for path in paths:
        state = S.ROUTED
        for event in path:
            state = advance(state, event)
        ends.append(state)
    assert ends == [S.DONE, S.DONE, S.FAILED, S.ABORTED]


def test_decode_has_it_once_its_first_delta_was_taken() -> None:
    assert [s for s in S if decode_has_it(s)] == [S.TRANSFERRED, S.ADMITTED, S.DONE]
