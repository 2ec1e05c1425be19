"""A prefill rank's sender table (`workers.prefill_senders.KVSenders`) re-wired after a decode instance
changed its ranks: a rank still at its address keeps its sender (a handoff open on it goes on), a rank
that left has its sender closed."""

from __future__ import annotations

from pdcluster.workers.prefill_senders import KVSenders

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"  # gRPC channels connect lazily: nothing listens


def test_a_rank_at_the_same_address_keeps_its_sender_and_a_gone_one_is_closed():
    senders = KVSenders("prefill-0", "cpu")
    senders.connect("grpc", [[A], [B]])
    first_a, first_b = senders.table[0][0], senders.table[1][0]
    senders.connect("grpc", [[A, C], [B]])  # decode-0 grew a rank at C
    assert senders.table[0][0] is first_a and senders.table[1][0] is first_b
    assert not first_a._closed and not first_b._closed
    grown = senders.table[0][1]
    senders.connect("grpc", [[C], [B]])  # decode-0 lost the rank at A
    assert senders.table == [[grown], [first_b]] and first_a._closed and not grown._closed
    senders.connect("grpc", [[C], [B]], tls=None)
    assert senders.table == [[grown], [first_b]]


def test_a_replaced_rank_and_another_transport_get_new_senders():
    senders = KVSenders("prefill-0", "cpu")
    senders.connect("grpc", [[A]])
    old = senders.table[0][0]
    senders.replace(0, B)  # restarted at another address
    assert senders.table[0][0] is not old and old._closed
    replaced = senders.table[0][0]
    senders.connect("grpc", [[B]])
    assert senders.table[0][0] is replaced
    senders.connect("shm", [["/nonexistent/kv.sock"]])  # another transport: every sender is new
    assert replaced._closed and senders.transports() == [["shm"]]
