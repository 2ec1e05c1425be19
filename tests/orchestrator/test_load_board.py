"""`LoadBoard`: the router's view without a load call per request (pure; no Ray)."""

from __future__ import annotations

import pytest

from pdcluster.driver.load_board import LoadBoard
from pdcluster.driver.messages import DecodeNodeLoad
from pdcluster.driver.router import DecodeLoad, RankRef


def _decode(free: int, running: int, taken_s: float, pid: int = 100, reserved: int = 0) -> DecodeNodeLoad:
    return DecodeNodeLoad(
        name="decode-0",
        pid=pid,
        num_free_blocks=free,
        num_total_blocks=64,
        num_running=running,
        num_reserved=reserved,
        num_waiting_for_seat=0,
        engine_thread_alive=True,
        num_engine_errors=0,
        last_engine_error=None,
        taken_s=taken_s,
    )


def test_missing_decodes_until_every_rank_reported():
    board = LoadBoard([1, 2])
    assert board.missing_decodes([0, 1]) == [0, 1]
    board.update_decode(RankRef(1, 0), _decode(10, 0, 1.0))
    assert board.missing_decodes([0, 1]) == [0, 1]  # rank 1 of instance 1 not yet
    board.update_decode(RankRef(1, 1), _decode(20, 0, 1.0))
    board.update_decode(RankRef(0, 0), _decode(30, 0, 1.0))
    assert board.missing_decodes([0, 1]) == []
    assert board.decode_loads(1) == [DecodeLoad(1, 10, 0, 0), DecodeLoad(1, 20, 0, 1)]
    board.forget_decode(1)
    assert board.missing_decodes([0, 1]) == [1]
    with pytest.raises(KeyError):
        board.decode_snapshots(1)


def test_a_late_reply_never_overwrites_a_newer_snapshot_of_the_same_process():
    board = LoadBoard([1])
    rank = RankRef(0, 0)
    board.update_decode(rank, _decode(5, 3, taken_s=2.0))
    board.update_decode(rank, _decode(50, 0, taken_s=1.0))  # older: ignored
    assert board.decode_loads(0) == [DecodeLoad(0, 5, 3, 0)]
    # A restarted actor (another pid) has another clock: its snapshot replaces the old one.
    board.update_decode(rank, _decode(60, 0, taken_s=0.5, pid=200))
    assert board.decode_loads(0) == [DecodeLoad(0, 60, 0, 0)]


def test_reserves_in_flight_count_in_the_batch_until_answered():
    board = LoadBoard([1])
    rank = RankRef(0, 0)
    board.update_decode(rank, _decode(40, 1, taken_s=1.0))
    board.reserve_sent(rank)
    board.reserve_sent(rank)
    assert board.decode_loads(0) == [DecodeLoad(0, 40, 3, 0)]
    board.reserve_answered(rank, _decode(36, 1, taken_s=2.0, reserved=1))  # the reply's snapshot
    assert board.decode_loads(0) == [DecodeLoad(0, 36, 3, 0)]  # 1 running + 1 reserved + 1 in flight
    board.reserve_answered(rank, None)  # the other call failed: no snapshot
    assert board.decode_loads(0) == [DecodeLoad(0, 36, 2, 0)]
    with pytest.raises(ValueError, match="never sent"):
        board.reserve_answered(rank, None)


def test_prefill_tokens_in_flight():
    board = LoadBoard([1])
    a, b = RankRef(0, 0), RankRef(1, 1)
    board.prefill_started(a, 100)
    board.prefill_started(a, 28)
    board.prefill_started(b, 7)
    assert (board.prefill_queued_tokens(a), board.prefill_queued_tokens(b)) == (128, 7)
    assert (board.prefill_calls(a), board.prefill_calls(b)) == (2, 1)
    board.prefill_ended(a, 100)
    board.prefill_ended(b, 7)
    assert (board.prefill_queued_tokens(a), board.prefill_queued_tokens(b)) == (28, 0)
    assert (board.prefill_calls(a), board.prefill_calls(b)) == (1, 0)
    with pytest.raises(ValueError, match="fewer in flight"):
        board.prefill_ended(b, 1)
    with pytest.raises(ValueError, match=">= 0"):
        board.prefill_started(a, -1)


def test_bad_ranks_are_refused():
    with pytest.raises(ValueError, match="at least one rank"):
        LoadBoard([1, 0])
    board = LoadBoard([2])
    with pytest.raises(ValueError, match=r"no decode rank \(0, 2\)"):
        board.update_decode(RankRef(0, 2), _decode(1, 0, 0.0))
    with pytest.raises(ValueError, match=r"no decode rank \(1, 0\)"):
        board.reserve_sent(RankRef(1, 0))


def test_a_reserve_sent_before_its_instance_was_re_formed_is_forgotten_when_it_answers():
    """Elastic EP re-counts an instance's ranks while reserves to it are in flight: their answers neither
    fail their requests nor count against the re-formed ranks' batches."""
    board = LoadBoard([2])
    old = board.reserve_sent(RankRef(0, 1))
    board.set_decode_ranks(0, 1)
    new = board.reserve_sent(RankRef(0, 0))
    board.reserve_answered(RankRef(0, 1), _decode(36, 1, taken_s=2.0), old)  # stale: dropped
    board.update_decode(RankRef(0, 0), _decode(30, 0, taken_s=1.0))
    assert [load.num_running for load in board.decode_loads(0)] == [1]  # the new reserve only
    board.reserve_answered(RankRef(0, 0), None, new)
    assert [load.num_running for load in board.decode_loads(0)] == [0]
    with pytest.raises(ValueError, match="never sent"):
        board.reserve_answered(RankRef(0, 0), None, new)
