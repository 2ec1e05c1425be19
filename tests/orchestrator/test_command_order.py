"""`CommandOrder`: a rank admits the driver's commands in their stream's order."""

from __future__ import annotations

import threading

import pytest

from pdcluster.driver.command_order import CommandOrder, CommandSeq, StaleCommand

WAIT_S = 5.0  # bound on a thread's join; the orders below never need it


def _run_in_thread(order: CommandOrder, seq: CommandSeq, log: list) -> threading.Thread:
    def body() -> None:
        with order.turn(seq):
            log.append(seq.seq)

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def test_commands_run_in_sequence_whatever_order_they_come_in() -> None:
    order, log = CommandOrder(gap_timeout_s=WAIT_S), []
    late = [_run_in_thread(order, CommandSeq("s", n), log) for n in (3, 2)]
    for thread in late:
        thread.join(0.1)
        assert thread.is_alive()  # waiting for command 1
    with order.turn(CommandSeq("s", 1)):
        log.append(1)
    for thread in late:
        thread.join(WAIT_S)
    assert log == [1, 2, 3]


def test_commands_without_a_place_go_at_once() -> None:
    order, log = CommandOrder(gap_timeout_s=WAIT_S), []
    with order.turn(CommandSeq("s", 1)):
        log.append(1)
    with order.turn(None):
        log.append(None)
    assert log == [1, None]


def test_a_gap_is_skipped_after_the_timeout_and_its_late_command_refused() -> None:
    order = CommandOrder(gap_timeout_s=0.05)
    with order.turn(CommandSeq("s", 2)):  # command 1 never comes in time
        pass
    assert order.num_gaps_skipped == 1
    with pytest.raises(StaleCommand):
        with order.turn(CommandSeq("s", 1)):
            pytest.fail("a command after its stream moved past it must not run")


def test_a_new_stream_starts_over_and_the_old_one_is_refused() -> None:
    order, log = CommandOrder(gap_timeout_s=WAIT_S), []
    with order.turn(CommandSeq("old", 1)):
        log.append("old-1")
    waiting = _run_in_thread(order, CommandSeq("new", 2), log)
    with order.turn(CommandSeq("new", 1)):
        log.append(1)
    waiting.join(WAIT_S)
    assert log == ["old-1", 1, 2]
    with pytest.raises(StaleCommand):
        with order.turn(CommandSeq("old", 2)):
            pass
    with order.turn(CommandSeq("new", 3)):  # the new stream goes on after the refusal
        log.append(3)
    assert log[-1] == 3
