"""`orchestrator.reply_channel`: prefill results pushed to the driver over its Unix socket, in one process
(the listener's thread and a pusher, as a prefill rank holds it), and how the driver takes a pushed result
(`RequestDispatch._on_prefill_reply`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import socket
import time
from types import SimpleNamespace

import pytest

from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.kvtransfer.base import HandoffMeta
from pdcluster.kvtransfer.shm_transport.channel import connect
from pdcluster.kvtransfer.shm_transport.channel import single_packet as _packet
from pdcluster.orchestrator import reply_channel
from pdcluster.orchestrator.dispatch import PrefillDone, PrefillFailed
from pdcluster.orchestrator.health_monitor import _prefill_pending
from pdcluster.orchestrator.load_board import LoadBoard
from pdcluster.orchestrator.messages import (
    DecodeNodeLoad,
    DraftCounts,
    Phases,
    PolledEvent,
    PrefillBind,
    PrefillResult,
    RequestError,
    TokenDelta,
)
from pdcluster.orchestrator.reply_channel import ReplyListener
from pdcluster.orchestrator.reply_pusher import ReplyPusher
from pdcluster.orchestrator.reply_records import (
    bind_from_record,
    bind_to_record,
    events_from_record,
    events_to_record,
    handoff_tag,
    result_from_record,
    result_to_record,
)
from pdcluster.orchestrator.request_dispatch import RequestDispatch
from pdcluster.orchestrator.request_state import Attempt
from pdcluster.orchestrator.router import RankRef

WAIT_S = 10.0  # a bound on one record crossing a local socket and a thread hop on a loaded machine
SECRET = b"s" * 32  # a handoff's secret (`HandoffMeta.secret`)
RESULT = PrefillResult(
    first_token_id=7, num_drafts=1, queue_s=0.001, prefill_s=0.02, last_layer_sent_s=0.019,
    first_token_text=" the", cpu_wait_s=0.004,
)  # fmt: skip


@pytest.fixture
def listener():
    got: queue.Queue = queue.Queue()
    listener = ReplyListener(lambda handoff_id, tag, result: got.put((handoff_id, tag, result)))
    yield listener, got
    listener.close()


def _assert_closed_by_the_listener(sock: socket.socket) -> None:
    """The listener writes only binds, only to a prefill rank's authenticated connection: on any other a
    read returns only once it closed it (an end of file, or a reset when packets it did not read were still
    queued)."""
    sock.settimeout(WAIT_S)
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def test_a_pushed_result_reaches_the_driver_as_it_was_sent(listener) -> None:
    listener, got = listener
    pusher = ReplyPusher(listener.address, listener.secret)
    pusher.push("r1@0", SECRET, RESULT)
    pusher.push("r2@0", SECRET, PrefillResult(3, 0, 0.0, 0.5))  # the optional fields left out
    assert got.get(timeout=WAIT_S) == ("r1@0", handoff_tag(SECRET), RESULT)
    assert got.get(timeout=WAIT_S) == ("r2@0", handoff_tag(SECRET), PrefillResult(3, 0, 0.0, 0.5))
    pusher.close()


def test_connections_without_the_secret_are_closed_and_deliver_nothing(listener, monkeypatch) -> None:
    """A wrong secret, a result before any hello, a record in several packets, or no hello in time: each
    connection is closed and nothing it sent is delivered; an honest rank's result still is."""
    listener, got = listener
    wrong = connect(listener.address).sock
    wrong.send(_packet({"k": "hello", "secret": "0" * 32}))
    with contextlib.suppress(OSError):  # the listener may have closed it already (a broken pipe)
        wrong.send(_packet(result_to_record("forged@0", handoff_tag(SECRET), RESULT)))
    _assert_closed_by_the_listener(wrong)
    no_hello = connect(listener.address).sock
    no_hello.send(_packet(result_to_record("forged@1", handoff_tag(SECRET), RESULT)))
    _assert_closed_by_the_listener(no_hello)
    split = connect(listener.address).sock
    split.send(b"M" + b"\x81")  # the first packet of a record that would go on: never held for the rest
    _assert_closed_by_the_listener(split)
    monkeypatch.setattr(reply_channel, "HELLO_TIMEOUT_S", 0.2)
    silent = connect(listener.address).sock
    _assert_closed_by_the_listener(silent)
    honest = ReplyPusher(listener.address, listener.secret)
    honest.push("ok@0", SECRET, RESULT)
    assert got.get(timeout=WAIT_S) == ("ok@0", handoff_tag(SECRET), RESULT)  # only the authenticated one's
    assert got.empty()
    honest.close()


def test_a_malformed_record_is_dropped_and_the_connection_goes_on(listener) -> None:
    listener, got = listener
    pusher = ReplyPusher(listener.address, listener.secret)
    bad = result_to_record("bad@0", handoff_tag(SECRET), RESULT)
    bad["r"]["first_token_id"] = "7"
    pusher._sock.send(_packet(bad))
    pusher.push("good@0", SECRET, RESULT)
    assert got.get(timeout=WAIT_S) == ("good@0", handoff_tag(SECRET), RESULT)
    assert got.empty()
    pusher.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rid": 5}, "string rid"),
        ({"tag": None}, "string tag"),
        ({"r": {"first_token_id": 1}}, "are not"),
        ({"r": {**result_to_record("x", "t", RESULT)["r"], "num_drafts": True}}, "num_drafts is bool"),
        ({"r": {**result_to_record("x", "t", RESULT)["r"], "queue_s": "1"}}, "queue_s is str"),
        ({"r": {**result_to_record("x", "t", RESULT)["r"], "handoff_finished": 0}}, "finished is int"),
    ],
)
def test_result_from_record_names_what_is_malformed(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        result_from_record({**result_to_record("x", "t", RESULT), **change})


def test_an_early_result_round_trips() -> None:
    early = dataclasses.replace(RESULT, num_drafts=0, last_layer_sent_s=None, handoff_finished=False)
    assert result_from_record(result_to_record("x@0", "t", early)) == ("x@0", "t", early)


def test_a_push_to_a_listener_gone_never_raises(listener) -> None:
    listener, _ = listener
    pusher = ReplyPusher(listener.address, listener.secret)
    listener.close()
    for i in range(3):  # the first may still go into the socket buffer; then the peer is gone
        pusher.push(f"late@{i}", SECRET, RESULT)
    pusher.close()
    pusher.push("after-close@0", SECRET, RESULT)


def _driver(*attempts: Attempt) -> SimpleNamespace:
    """What `RequestDispatch._on_prefill_reply` reads of the driver."""
    return SimpleNamespace(
        _by_handoff={a.handoff_id: a for a in attempts},
        _num_prefill_replies_received=0,
        _num_prefill_replies_pushed=0,
        _num_first_tokens_early=0,
    )


def _attempt(handoff_id: str, secret: bytes | None) -> Attempt:
    attempt = Attempt(handoff_id, RankRef(0, 0), RankRef(0, 0))
    if secret is not None:
        attempt.meta = SimpleNamespace(secret=secret)
    attempt.prefill_call = SimpleNamespace(done=lambda: False)  # the Ray call has not returned
    return attempt


def test_the_driver_takes_a_pushed_result_once_and_only_for_its_own_attempt() -> None:
    """The first push for a reserved attempt is its PrefillDone (and its prefill is no longer pending for the
    health monitor); a second one, one for an unknown id, one for an attempt not reserved yet, and one whose
    tag is another reservation's (an earlier request's under a reused id) are dropped."""
    current, unbound, earlier = _attempt("r@0", SECRET), _attempt("u@0", None), _attempt("e@0", SECRET)
    driver = _driver(current, unbound, earlier)
    on_reply = RequestDispatch._on_prefill_reply
    assert _prefill_pending(current)
    on_reply(driver, "r@0", handoff_tag(SECRET), RESULT)
    assert current.prefill_reported and not _prefill_pending(current)
    assert current.events.get_nowait() == PrefillDone(RESULT)
    on_reply(driver, "r@0", handoff_tag(SECRET), RESULT)  # the same again (or after the call's reply)
    on_reply(driver, "gone@0", handoff_tag(SECRET), RESULT)
    on_reply(driver, "u@0", handoff_tag(SECRET), RESULT)
    on_reply(driver, "e@0", handoff_tag(b"another reservation's secret...."), RESULT)
    assert current.events.empty() and unbound.events.empty() and earlier.events.empty()
    assert not unbound.prefill_reported and not earlier.prefill_reported
    assert (driver._num_prefill_replies_received, driver._num_prefill_replies_pushed) == (5, 1)


def test_an_early_first_token_is_the_attempts_prefill_done_and_the_finished_result_follows_it() -> None:
    """A result pushed as soon as the first token was sampled (`handoff_finished` False) is the attempt's
    PrefillDone (its token streams); the finished result after it is queued too (for its phases), once;
    a second early one is dropped. Without an early one, the finished result is the PrefillDone alone."""
    early = dataclasses.replace(RESULT, num_drafts=0, last_layer_sent_s=None, handoff_finished=False)
    attempt, plain = _attempt("r@0", SECRET), _attempt("p@0", SECRET)
    driver = _driver(attempt, plain)
    on_reply = RequestDispatch._on_prefill_reply
    on_reply(driver, "r@0", handoff_tag(SECRET), early)
    # Its MTP layer and the handoff's finish are still to come: a prefill lost now fails the attempt.
    assert attempt.prefill_reported and attempt.first_token_early and _prefill_pending(attempt)
    on_reply(driver, "r@0", handoff_tag(SECRET), early)  # dropped
    on_reply(driver, "r@0", handoff_tag(SECRET), RESULT)
    assert not _prefill_pending(attempt)
    on_reply(driver, "r@0", handoff_tag(SECRET), RESULT)  # (the call's reply, or a repeat): dropped
    assert [attempt.events.get_nowait() for _ in range(2)] == [PrefillDone(early), PrefillDone(RESULT)]
    assert attempt.events.empty() and not attempt.first_token_early
    on_reply(driver, "p@0", handoff_tag(SECRET), RESULT)
    on_reply(driver, "p@0", handoff_tag(SECRET), RESULT)
    assert plain.events.get_nowait() == PrefillDone(RESULT) and plain.events.empty()
    assert (driver._num_prefill_replies_pushed, driver._num_first_tokens_early) == (2, 1)


@pytest.mark.parametrize("outcome", ["fails", "returns"])
def test_after_an_early_first_token_the_prefill_call_is_still_waited_on(outcome) -> None:
    """`RequestDispatch._next_events` after an early result: the prefill call is still watched, so a failure
    before its finished result is the attempt's PrefillFailed at once (the instance marked when lost), not
    a wait for decode's lease; a call that returns is the finished result (PrefillDone, for its phases),
    and then the call is no longer waited on."""
    from pdcluster.orchestrator.routing import RouteAndReserve

    early = dataclasses.replace(RESULT, num_drafts=0, last_layer_sent_s=None, handoff_finished=False)

    async def run() -> None:
        attempt = _attempt("r@0", SECRET)
        attempt.prefill_call = call = asyncio.get_running_loop().create_future()
        marked: list = []
        driver = _driver(attempt)
        driver.event_timeout_s = 30.0
        driver._is_lost = RouteAndReserve._is_lost
        driver._mark_failed = lambda *args: marked.append(args[:4])
        record = SimpleNamespace(aborted=False)
        RequestDispatch._on_prefill_reply(driver, "r@0", handoff_tag(SECRET), early)

        def next_events():
            return asyncio.wait_for(RequestDispatch._next_events(driver, record, attempt, call), 5.0)

        assert await next_events() == [PrefillDone(early)]
        if outcome == "fails":
            call.set_exception(TimeoutError("no answer"))
            assert await next_events() == [PrefillFailed("TimeoutError: no answer within 30 s")]
            ((role, index, error, call_name),) = marked
            assert (role, index, type(error), call_name) == ("prefill", 0, TimeoutError, "prefill")
        else:
            call.set_result(RESULT)
            assert await next_events() == [PrefillDone(RESULT)] and not marked
        assert not attempt.first_token_early and not _prefill_pending(attempt)
        attempt.events.put_nowait(PrefillDone(RESULT))  # (a late push): the call is not waited on again
        assert await next_events() == [PrefillDone(RESULT)]

    asyncio.run(run())


def test_refused_connections_are_logged_once_per_interval_not_once_each(listener, caplog) -> None:
    """A local process looping on connect with a wrong secret does not flood the driver's log: one line per
    `REFUSAL_LOG_INTERVAL_S`, carrying the count."""
    listener, _ = listener
    caplog.set_level("WARNING", logger="pdcluster.orchestrator.reply_channel")
    for _ in range(5):
        sock = connect(listener.address).sock
        sock.send(_packet({"k": "hello", "secret": "0" * 32}))
        _assert_closed_by_the_listener(sock)
        sock.close()
    refusals = [r for r in caplog.records if "refused or closed" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # the first; the next 4 within 10 s


LOAD = DecodeNodeLoad(
    name="decode-0", pid=4242, num_free_blocks=90, num_total_blocks=128, num_running=2, num_reserved=1,
    num_waiting_for_seat=0, engine_thread_alive=True, num_engine_errors=0, last_engine_error=None,
    ep={"num_tokens": 3}, taken_s=12.5,
)  # fmt: skip
DELTA = TokenDelta(
    "r@0", (5, 6), finished=True, finish_reason="length", phases=Phases(kv_transfer_s=0.004, admit_s=0.001),
    kv_transfer_bytes=12_800, drafts=DraftCounts(4, 3, (4,), (3,)), new_text=" a b",
    logprobs=(TokenLogprobs(5, -0.25, 1, [5, 9], [-0.25, -2.5]), TokenLogprobs(6, -1.5, 2, [], [])),
)  # fmt: skip
EVENTS = [
    PolledEvent(7, TokenDelta("r@0", (4,))),
    PolledEvent(8, DELTA),
    PolledEvent(9, RequestError("q@1", "x")),
]


def test_pushed_events_reach_the_driver_as_they_were_sent_under_the_rank_tag(listener) -> None:
    """A decode rank's events and load arrive whole, tagged with the `who` of its hello; a prefill rank's
    connection (no tag) that sends events has them dropped, and a result still reaches `on_result`."""
    _, got_results = listener
    got: queue.Queue = queue.Queue()
    listener = ReplyListener(lambda *r: got_results.put(r), lambda who, ev, load: got.put((who, ev, load)))
    try:
        decode = ReplyPusher(listener.address, listener.secret, who="decode-0:t1")
        assert decode.push_events(EVENTS, LOAD)
        assert got.get(timeout=WAIT_S) == ("decode-0:t1", EVENTS, LOAD)
        prefill = ReplyPusher(listener.address, listener.secret)
        assert prefill.push_events(EVENTS, LOAD)  # sent, but a prefill rank has no events to give
        prefill.push("ok@0", SECRET, RESULT)
        assert got_results.get(timeout=WAIT_S) == ("ok@0", handoff_tag(SECRET), RESULT)
        assert got.empty()
        decode.close()
        assert not decode.push_events(EVENTS, LOAD)  # closed: the poll brings them
        prefill.close()
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"e": []}, "non-empty list e"),
        ({"l": {**dataclasses.asdict(LOAD), "pid": "1"}}, "pid is str"),
        ({"l": {"name": "decode-0"}}, "load fields"),
        (
            {"e": [[1, "delta", "r", [1], False, None, {"nope_s": 1.0}, None, [0, 0, [], []], "", None]]},
            "phases",
        ),
        (
            {"e": [[1, "delta", "r", [1.5], False, None, {}, None, [0, 0, [], []], "", None]]},
            "new_token_ids is float",
        ),
        ({"e": [[1, "delta", "r", [1], 0, None, {}, None, [0, 0, [], []], "", None]]}, "finished is int"),
        ({"e": [[1, "delta", "r", [1], False, None, {}, None, [0, 0, [], []], "", [[1]]]]}, "token logprobs"),
        ({"e": [[1, "delta", "r", [1], False, None, {}, None, [0, 0, [], []], "", []]]}, "logprobs"),
        ({"e": [[1, "error", "r"]]}, "kind 'error' with 3 fields"),
        ({"e": [[1, "error", "r", "m"], [3, "error", "r", "m"]]}, "out of sequence"),
        ({"e": [["1", "error", "r", "m"]]}, "seq is str"),
    ],
)
def test_events_from_record_names_what_is_malformed(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        events_from_record({**events_to_record(EVENTS, LOAD), **change})


def _decode_driver(routable: bool = True) -> SimpleNamespace:
    """What `RequestDispatch._on_decode_events` reads of the driver: one decode instance of one rank."""
    driver = SimpleNamespace(
        _decode_push_tags={"decode-0:new": RankRef(0, 0)},
        instances={"decode": [SimpleNamespace(routable=routable)]},
        _loads=LoadBoard([1]),
        _poll_acked_seq=[[6]],
        _by_handoff={"r@0": _attempt("r@0", SECRET), "q@1": _attempt("q@1", SECRET)},
        _num_decode_events_pushed=0,
    )
    driver._hand_over = lambda ref, events: RequestDispatch._hand_over(driver, ref, events)
    return driver


def _queued(attempt: Attempt) -> list:
    return [attempt.events.get_nowait() for _ in range(attempt.events.qsize())]


def test_the_driver_takes_pushed_events_once_in_sequence_and_only_under_the_current_tag() -> None:
    driver = _decode_driver()
    on_events = RequestDispatch._on_decode_events
    on_events(driver, "decode-0:old", EVENTS, LOAD)  # a restarted rank's predecessor: dropped
    assert driver._poll_acked_seq == [[6]] and driver._loads.missing_decodes([0]) == [0]
    on_events(driver, "decode-0:new", EVENTS[1:], LOAD)  # 8 after 6: a gap (7 comes by the poll)
    assert driver._poll_acked_seq == [[6]] and driver._num_decode_events_pushed == 0
    on_events(driver, "decode-0:new", EVENTS, LOAD)
    assert driver._poll_acked_seq == [[9]] and driver._num_decode_events_pushed == 3
    assert _queued(driver._by_handoff["r@0"]) == [EVENTS[0].event, DELTA]
    assert _queued(driver._by_handoff["q@1"]) == [EVENTS[2].event]
    assert driver._loads.decode_snapshots(0) == [LOAD]  # the load came with them
    on_events(driver, "decode-0:new", EVENTS, LOAD)  # again (e.g. the poll brought them first)
    assert driver._num_decode_events_pushed == 3 and driver._by_handoff["r@0"].events.empty()


def test_pushed_events_of_a_rank_out_of_routing_are_handed_over_but_its_load_is_not() -> None:
    driver = _decode_driver(routable=False)
    RequestDispatch._on_decode_events(driver, "decode-0:new", EVENTS, LOAD)
    assert driver._poll_acked_seq == [[9]] and driver._loads.missing_decodes([0]) == [0]


# ---- binds, driver -> prefill rank ---------------------------------------------------------------------
BIND = PrefillBind(
    "r@0",
    HandoffMeta(
        "r@0", num_layers=5, num_tokens=64, kv_dim=80, dtype="float32", wire_dtype="float32", secret=SECRET
    ),
    1,
    0,
)


def _send_bind_once_registered(listener: ReplyListener, who: str, bind: PrefillBind) -> None:
    """`send_bind` as soon as the listener thread has taken `who`'s hello (it sends False until then)."""
    deadline_s = time.monotonic() + WAIT_S
    while not listener.send_bind(who, bind):
        assert time.monotonic() < deadline_s, f"no connection of {who} registered in {WAIT_S} s"
        time.sleep(0.01)


def test_a_bind_reaches_the_prefill_rank_of_its_tag_only() -> None:
    """A bind goes to the prefill connection whose hello named the tag, whole (the secret included), and to
    no other rank; never to a decode rank's connection (its hello taken: its events arrived) or an unknown
    tag; after the rank closes its connection it is not sent (the caller makes the Ray call), and a new
    connection under the tag (a restarted rank) takes the binds from then on. A second connection under a
    tag still open takes none. The prefill rank's results still reach the driver."""
    results: queue.Queue = queue.Queue()
    events: queue.Queue = queue.Queue()
    listener = ReplyListener(lambda *r: results.put(r), lambda who, ev, load: events.put(who))
    binds_0: queue.Queue = queue.Queue()
    binds_1: queue.Queue = queue.Queue()
    pushers = []
    try:
        prefill_0 = ReplyPusher(listener.address, listener.secret, "prefill-0:a", on_bind=binds_0.put)
        prefill_1 = ReplyPusher(listener.address, listener.secret, "prefill-1:b", on_bind=binds_1.put)
        decode = ReplyPusher(listener.address, listener.secret, "decode-0:c")
        pushers += [prefill_0, prefill_1, decode]
        _send_bind_once_registered(listener, "prefill-0:a", BIND)
        taken = binds_0.get(timeout=WAIT_S)
        assert taken == BIND and taken.meta.secret == SECRET
        assert prefill_0.num_binds_received == 1
        second = ReplyPusher(listener.address, listener.secret, "prefill-0:a", on_bind=binds_1.put)
        pushers.append(second)
        assert decode.push_events(EVENTS, LOAD)
        assert events.get(timeout=WAIT_S) == "decode-0:c"  # its hello was taken before these
        assert not listener.send_bind("decode-0:c", BIND) and not listener.send_bind("nobody", BIND)
        prefill_0.push("r@0", SECRET, RESULT)
        assert results.get(timeout=WAIT_S) == ("r@0", handoff_tag(SECRET), RESULT)
        prefill_0.close()
        second.close()
        deadline_s = time.monotonic() + WAIT_S
        while listener.send_bind("prefill-0:a", BIND):  # until the listener saw the connection end
            assert time.monotonic() < deadline_s
            time.sleep(0.01)
        restarted = ReplyPusher(listener.address, listener.secret, "prefill-0:a", on_bind=binds_0.put)
        pushers.append(restarted)
        rebound = dataclasses.replace(BIND, decode_index=0)
        _send_bind_once_registered(listener, "prefill-0:a", rebound)
        assert binds_0.get(timeout=WAIT_S) == rebound
        assert binds_1.empty() and prefill_1.num_binds_received == 0 and second.num_binds_received == 0
    finally:
        for pusher in pushers:
            pusher.close()
        listener.close()


def test_the_bind_reader_ends_when_the_driver_goes_and_the_rank_pushes_no_more(listener) -> None:
    """The driver's end closes (the listener stops): the prefill rank's reader thread ends and marks the
    connection broken, so its pushes return at once (the Ray reply carries the result)."""
    listener, _ = listener
    pusher = ReplyPusher(listener.address, listener.secret, "prefill-0:a", on_bind=lambda bind: None)
    try:
        assert pusher._reader is not None and pusher._reader.is_alive()
        listener.close()
        pusher._reader.join(WAIT_S)
        assert not pusher._reader.is_alive()
        assert not pusher.push_events(EVENTS, LOAD)
    finally:
        pusher.close()


def test_a_malformed_record_from_the_driver_is_dropped_and_the_binds_go_on(listener, caplog) -> None:
    listener, _ = listener
    binds: queue.Queue = queue.Queue()
    pusher = ReplyPusher(listener.address, listener.secret, "prefill-0:a", on_bind=binds.put)
    try:
        _send_bind_once_registered(listener, "prefill-0:a", BIND)
        assert binds.get(timeout=WAIT_S) == BIND
        sock = listener._registered["prefill-0:a"].sock
        sock.send(_packet({**bind_to_record(BIND), "d": -1}))
        sock.send(_packet({"k": "done"}))
        listener.send_bind("prefill-0:a", dataclasses.replace(BIND, decode_rank=1))
        assert binds.get(timeout=WAIT_S).decode_rank == 1
        assert binds.empty() and pusher.num_binds_received == 2
        messages = [
            r.getMessage() for r in caplog.records if "malformed record from the driver" in r.getMessage()
        ]
        assert len(messages) == 2 and not any(SECRET.decode() in m for m in messages)
    finally:
        pusher.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rid": 5}, "string rid"),
        ({"m": None}, "mapping m"),
        ({"d": -1}, "decode_index is -1"),
        ({"r": True}, "decode_rank is True"),
        ({"m": {**bind_to_record(BIND)["m"], "num_layers": "5"}}, "malformed handoff"),
        ({"m": {**bind_to_record(BIND)["m"], "request_id": "other@0"}}, "names 'other@0'"),
        ({"m": {**bind_to_record(BIND)["m"], "secret": b""}}, "no secret"),
    ],
)
def test_bind_from_record_names_what_is_malformed(change, message) -> None:
    assert bind_from_record(bind_to_record(BIND)) == BIND
    with pytest.raises(ValueError, match=message) as info:
        bind_from_record({**bind_to_record(BIND), **change})
    assert SECRET.decode() not in str(info.value)
