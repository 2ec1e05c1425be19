"""`orchestrator.reply_channel`: prefill results pushed to the driver over its Unix socket, in one process
(the listener's thread and a pusher, as a prefill rank would hold it)."""

from __future__ import annotations

import contextlib
import queue

import pytest

from kvtransfer.shm_transport.channel import connect
from orchestrator.messages import PrefillResult
from orchestrator.reply_channel import ReplyListener, ReplyPusher, result_from_record, result_to_record

WAIT_S = 10.0  # a bound on one record crossing a local socket and a thread hop on a loaded machine
RESULT = PrefillResult(
    first_token_id=7, num_drafts=1, queue_s=0.001, prefill_s=0.02, last_layer_sent_s=0.019,
    first_token_text=" the", cpu_wait_s=0.004,
)  # fmt: skip


@pytest.fixture
def listener():
    got: queue.Queue = queue.Queue()
    listener = ReplyListener(lambda handoff_id, result: got.put((handoff_id, result)))
    yield listener, got
    listener.close()


def test_a_pushed_result_reaches_the_driver_as_it_was_sent(listener) -> None:
    listener, got = listener
    pusher = ReplyPusher(listener.address, listener.secret)
    pusher.push("r1@0", RESULT)
    pusher.push("r2@0", PrefillResult(3, 0, 0.0, 0.5))  # the optional fields left out
    assert got.get(timeout=WAIT_S) == ("r1@0", RESULT)
    assert got.get(timeout=WAIT_S) == ("r2@0", PrefillResult(3, 0, 0.0, 0.5))
    pusher.close()


def _assert_closed_by_the_listener(channel) -> None:
    """The listener never writes to a connection: `recv` returns only once it closed it (an end of file,
    or a reset when records it did not read were still queued)."""
    channel.sock.settimeout(WAIT_S)
    try:
        assert channel.recv() is None
    except ConnectionResetError:
        pass


def test_a_connection_without_the_secret_is_closed_and_delivers_nothing(listener) -> None:
    listener, got = listener
    intruder = connect(listener.address)
    intruder.send({"k": "hello", "secret": "0" * 32})
    with contextlib.suppress(OSError):  # the listener may have closed it already (a broken pipe)
        intruder.send(result_to_record("forged@0", RESULT))
    _assert_closed_by_the_listener(intruder)
    no_hello = connect(listener.address)
    no_hello.send(
        result_to_record("forged@1", RESULT)
    )  # a result as the first record (sent before any close)
    _assert_closed_by_the_listener(no_hello)
    honest = ReplyPusher(listener.address, listener.secret)
    honest.push("ok@0", RESULT)
    assert got.get(timeout=WAIT_S) == ("ok@0", RESULT)  # only the authenticated one's
    assert got.empty()
    honest.close()


def test_a_malformed_record_is_dropped_and_the_connection_goes_on(listener) -> None:
    listener, got = listener
    pusher = ReplyPusher(listener.address, listener.secret)
    bad = result_to_record("bad@0", RESULT)
    bad["r"]["first_token_id"] = "7"
    pusher._channel.send(bad)
    pusher.push("good@0", RESULT)
    assert got.get(timeout=WAIT_S) == ("good@0", RESULT)
    assert got.empty()
    pusher.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rid": 5}, "string rid"),
        ({"r": {"first_token_id": 1}}, "are not"),
        ({"r": {**result_to_record("x", RESULT)["r"], "num_drafts": True}}, "num_drafts is bool"),
        ({"r": {**result_to_record("x", RESULT)["r"], "queue_s": "1"}}, "queue_s is str"),
    ],
)
def test_result_from_record_names_what_is_malformed(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        result_from_record({**result_to_record("x", RESULT), **change})


def test_a_push_to_a_listener_gone_never_raises(listener) -> None:
    listener, _ = listener
    pusher = ReplyPusher(listener.address, listener.secret)
    listener.close()
    for i in range(3):  # the first may still go into the socket buffer; then the peer is gone
        pusher.push(f"late@{i}", RESULT)
    pusher.close()
    pusher.push("after-close@0", RESULT)
