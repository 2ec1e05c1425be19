"""Calls over the driver's reply socket (`orchestrator.reply_channel`): decode reserves and prefill
requests. The records (`orchestrator.reply_records`), the round trip between a `ReplyListener` and a rank's
`ReplyPusher` in one process, and how the driver takes the answers (`RouteAndReserve._push_call` /
`_on_answer`)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import time
from types import SimpleNamespace

import pytest

from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kvtransfer.base import HandoffMeta
from pdcluster.kvtransfer.shm_transport.channel import single_packet
from pdcluster.orchestrator.messages import (
    DecodeNodeLoad,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    ReserveResult,
)
from pdcluster.orchestrator.rank_calls import RankConnectionLost
from pdcluster.orchestrator.reply_channel import ReplyListener
from pdcluster.orchestrator.reply_pusher import ReplyPusher
from pdcluster.orchestrator.reply_records import (
    CallAnswer,
    RankCall,
    RankCallRaised,
    answer_from_record,
    answer_to_record,
    call_from_record,
    call_to_record,
)
from pdcluster.orchestrator.routing import RouteAndReserve

WAIT_S = 10.0  # a bound on one record crossing a local socket and a thread hop on a loaded machine
SECRET = b"k" * 32
META = HandoffMeta("r@0", num_layers=5, num_tokens=3, kv_dim=80, dtype="float32", wire_dtype="float32")
BOUND = dataclasses.replace(META, secret=SECRET)
PARAMS = SamplingParams(
    temperature=0.7, top_p=0.9, top_k=20, seed=2**64 - 1, max_tokens=9, stop_token_ids=[2], stop=["\n\n"],
    logprobs=1,
)  # fmt: skip
RESERVE_REQUEST = ReserveRequest("r@0", (11, 12, 13), PARAMS, META, num_draft_tokens=1)
PREFILL_REQUEST = PrefillRequest(
    "r@0", (11, 12, 13), PARAMS, META, 1, 2, awaiting_bind=True, first_token_id=7
)
RESERVE = RankCall(3, RESERVE_REQUEST)
PREFILL = RankCall(4, PREFILL_REQUEST)
PREFILL_BOUND = RankCall(
    5, dataclasses.replace(PREFILL_REQUEST, meta=BOUND, awaiting_bind=False, first_token_id=None)
)
LOAD = DecodeNodeLoad(
    name="decode-0", pid=4242, num_free_blocks=90, num_total_blocks=128, num_running=2, num_reserved=1,
    num_waiting_for_seat=0, engine_thread_alive=True, num_engine_errors=0, last_engine_error=None,
    ep=None, taken_s=12.5,
)  # fmt: skip
RESULT = PrefillResult(first_token_id=7, num_drafts=1, queue_s=0.001, prefill_s=0.02, first_token_text=" a")


# ---- the records --------------------------------------------------------------------------------------
def test_calls_and_their_answers_survive_their_records() -> None:
    for call in (RESERVE, PREFILL, PREFILL_BOUND):
        assert call_from_record(call_to_record(call)) == call
    for result in (ReserveResult(BOUND, LOAD), ReserveResult(None, LOAD), ReserveResult(None, None)):
        assert answer_from_record(answer_to_record(RESERVE, result)) == (3, "rsv", "r@0", result)
    assert answer_from_record(answer_to_record(PREFILL, RESULT)) == (4, "pf", "r@0", RESULT)
    for raised in (ValueError("prompt too long"), RuntimeError("prefill failed")):
        call_id, kind, handoff_id, error = answer_from_record(answer_to_record(PREFILL, raised))
        assert (call_id, kind, handoff_id, type(error), str(error)) == (
            4,
            "pf",
            "r@0",
            type(raised),
            str(raised),
        )
    *_, error = answer_from_record(answer_to_record(RESERVE, KeyError("x")))
    assert isinstance(error, RankCallRaised) and str(error) == "KeyError: 'x'"


def _changed(call: RankCall, **fields) -> dict:
    return {**call_to_record(call), **fields}


_RESERVE_META = call_to_record(RESERVE)["m"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (_changed(RESERVE, k="zz"), "not a call"),
        (_changed(RESERVE, rid=1), "string rid"),
        (_changed(RESERVE, id="3"), "call id is str"),
        (_changed(RESERVE, t=[]), "non-empty"),
        (_changed(RESERVE, t=[1, -2]), "ints >= 0"),
        (_changed(RESERVE, t=[1.5]), "prompt_token_ids is float"),
        (_changed(RESERVE, n=-1), "num_draft_tokens is -1"),
        (_changed(RESERVE, p={**call_to_record(RESERVE)["p"], "temperature": -1}), "temperature must be"),
        (_changed(RESERVE, p={"temperature": 0}), "sampling parameters"),
        (_changed(RESERVE, m={**_RESERVE_META, "request_id": "q@0"}), "names 'q@0'"),
        (_changed(RESERVE, m={**_RESERVE_META, "secret": SECRET}), "has a secret"),
        (_changed(RESERVE, m={**_RESERVE_META, "num_layers": "5"}), "malformed handoff"),
        (_changed(PREFILL, d=-1), "decode_index is -1"),
        (_changed(PREFILL, r=True), "decode_rank is True"),
        (_changed(PREFILL, ab=1), "awaiting_bind is int"),
        (_changed(PREFILL, ft="7"), "first_token_id is str"),
        (_changed(PREFILL, ab=False), "secret exactly when it is bound"),
        (_changed(PREFILL_BOUND, ab=True), "secret exactly when it is bound"),
    ],
)
def test_call_from_record_names_what_is_malformed_never_the_secret(record, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        call_from_record(record)
    assert SECRET.decode() not in str(info.value)


_BOUND_META = answer_to_record(RESERVE, ReserveResult(BOUND))["ok"]["m"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rid": None}, "call kind c"),
        ({"c": "bind"}, "call kind c"),
        ({"id": None}, "call id is NoneType"),
        ({"err": ["ValueError"]}, "class name, message"),
        ({"ok": None}, "err or a mapping ok"),
        ({"ok": {"m": [1], "l": None}}, "mappings or nil"),
        ({"ok": {"m": {**_BOUND_META, "secret": b""}}}, "no secret"),
        ({"ok": {"m": None, "l": {"name": "decode-0"}}}, "load fields"),
        ({"c": "pf"}, "fields"),
    ],
)
def test_answer_from_record_names_what_is_malformed_never_the_secret(change, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        answer_from_record({**answer_to_record(RESERVE, ReserveResult(BOUND, LOAD)), **change})
    assert SECRET.decode() not in str(info.value)


# ---- the socket ---------------------------------------------------------------------------------------
def _answering(result_for):
    """A rank's `on_call` that answers each call with `result_for(request)` at once."""

    def on_call(call: RankCall, pusher: ReplyPusher) -> None:
        assert pusher.push_answer(call, result_for(call.request), WAIT_S)

    return on_call


def _send_once_registered(listener: ReplyListener, who: str, call: RankCall) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while not listener.send_call(who, call):
        assert time.monotonic() < deadline_s, f"no connection of {who} registered in {WAIT_S} s"
        time.sleep(0.01)


def _answers() -> tuple[queue.Queue, ReplyListener]:
    answers: queue.Queue = queue.Queue()
    return answers, ReplyListener(lambda *r: None, lambda *e: None, lambda who, a: answers.put((who, a)))


def test_a_call_reaches_its_rank_only_and_its_answer_comes_back_under_its_tag(caplog) -> None:
    """A reserve goes whole to the decode connection whose hello named the tag and said it takes calls, a
    prefill request to such a prefill connection; never to a rank of the other role, one that takes no
    calls, or an unknown tag. The answer (a reserve's bound meta with its secret and the load, a prefill's
    result, or the error) reaches `on_answer` under that tag with its call id. A second connection under
    the tag gets none and its answers are dropped. When the rank's connection closes, `on_answer` hears it
    (None), and no call is sent there any more."""
    answers, listener = _answers()
    taken: queue.Queue = queue.Queue()
    pushers = []

    def result_for(request):
        taken.put(request)
        if request.handoff_id == "bad@0":
            return ValueError("could never fit")
        if isinstance(request, PrefillRequest):
            return RESULT
        return ReserveResult(dataclasses.replace(request.meta, secret=SECRET), LOAD)

    def pusher(who: str, **handlers) -> ReplyPusher:
        pushers.append(ReplyPusher(listener.address, listener.secret, who, **handlers))
        return pushers[-1]

    try:
        decode = pusher("decode-0:a", on_call=_answering(result_for))
        prefill = pusher("prefill-0:c", on_bind=lambda b: None, on_call=_answering(result_for))
        pusher("decode-1:b")  # takes no calls
        pusher("prefill-1:d", on_bind=lambda b: None)  # takes binds only
        _send_once_registered(listener, "decode-0:a", RESERVE)
        assert taken.get(timeout=WAIT_S) == RESERVE_REQUEST
        assert answers.get(timeout=WAIT_S) == ("decode-0:a", (3, "rsv", "r@0", ReserveResult(BOUND, LOAD)))
        _send_once_registered(listener, "prefill-0:c", PREFILL)
        assert taken.get(timeout=WAIT_S) == PREFILL_REQUEST
        assert answers.get(timeout=WAIT_S) == ("prefill-0:c", (4, "pf", "r@0", RESULT))
        bad_meta = dataclasses.replace(META, request_id="bad@0")
        bad = RankCall(6, dataclasses.replace(RESERVE_REQUEST, handoff_id="bad@0", meta=bad_meta))
        assert listener.send_call("decode-0:a", bad)
        assert taken.get(timeout=WAIT_S) == bad.request
        who, (call_id, kind, handoff_id, error) = answers.get(timeout=WAIT_S)
        assert (who, call_id, kind, handoff_id, type(error), str(error)) == (
            "decode-0:a", 6, "rsv", "bad@0", ValueError, "could never fit"
        )  # fmt: skip
        for other in ("decode-1:b", "prefill-0:c", "nobody"):
            assert not listener.send_call(other, RESERVE)
        for other in ("decode-0:a", "prefill-1:d"):
            assert not listener.send_call(other, PREFILL)
        second = pusher("decode-0:a", on_call=_answering(result_for))
        # it was sent no call: its answer is dropped by the listener (seen before the close below)
        assert second.push_answer(RESERVE, ReserveResult(BOUND, LOAD), WAIT_S)
        deadline_s = time.monotonic() + WAIT_S
        while not any("was sent no call" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline_s, "the second connection's answer was not dropped"
            time.sleep(0.01)
        assert decode.num_calls_received == 2 and prefill.num_calls_received == 1
        assert second.num_calls_received == 0
        decode.close()
        assert answers.get(timeout=WAIT_S) == ("decode-0:a", None)
        assert answers.empty() and taken.empty()
        assert not listener.is_registered("decode-0:a")  # the second connection does not inherit the tag
        assert listener.dropped("decode-0:a")  # (the health monitor connects such a rank again)
        assert not listener.dropped("prefill-0:c")  # still open
        assert not listener.dropped("decode-1:b") and not listener.dropped("nobody")  # never registered
    finally:
        for p in pushers:
            p.close()
        listener.close()


def test_a_malformed_call_is_answered_with_its_error_and_the_calls_go_on(caplog) -> None:
    """A call the rank cannot read, whose id and handoff id it can, is answered at once with a RuntimeError
    naming what is wrong (the driver fails that request instead of waiting out its bound); the next call is
    served."""
    answers, listener = _answers()
    decode = ReplyPusher(
        listener.address,
        listener.secret,
        "decode-0:a",
        on_call=_answering(lambda r: ReserveResult(None, LOAD)),
    )
    try:
        _send_once_registered(listener, "decode-0:a", RESERVE)
        assert answers.get(timeout=WAIT_S) == ("decode-0:a", (3, "rsv", "r@0", ReserveResult(None, LOAD)))
        sock = listener._registered["decode-0:a"].sock
        sock.send(single_packet(_changed(RankCall(7, RESERVE_REQUEST), t=[])))
        who, (call_id, kind, handoff_id, error) = answers.get(timeout=WAIT_S)
        assert (who, call_id, kind, handoff_id, type(error)) == ("decode-0:a", 7, "rsv", "r@0", RuntimeError)
        assert "could not read the call" in str(error) and "non-empty" in str(error)
        assert listener.send_call("decode-0:a", RankCall(8, RESERVE_REQUEST))
        assert answers.get(timeout=WAIT_S) == ("decode-0:a", (8, "rsv", "r@0", ReserveResult(None, LOAD)))
        assert decode.num_calls_received == 2
        assert any("malformed record from the driver" in r.getMessage() for r in caplog.records)
    finally:
        decode.close()
        listener.close()


def test_an_answer_that_finds_no_room_waits_then_gives_up_without_holding_the_push_lock(monkeypatch) -> None:
    """`push_answer` waits for room in the driver's buffer up to its bound, outside the lock the engine
    thread's pushes take (checked while it waits); past the bound it says False (the rank then undoes the
    call, e.g. releases a reservation)."""
    listener = ReplyListener(lambda *r: None)
    pusher = ReplyPusher(listener.address, listener.secret, "decode-0:a", on_call=lambda r, p: None)
    real_sock = pusher._sock
    locked_while_waiting = []

    class Full:
        def send(self, packet):
            raise BlockingIOError

        def fileno(self):
            return real_sock.fileno()

    def wait(r, w, x, timeout_s):
        locked_while_waiting.append(pusher._lock.locked())
        time.sleep(timeout_s)
        return [], [], []

    try:
        monkeypatch.setattr(pusher, "_sock", Full())
        monkeypatch.setattr("pdcluster.orchestrator.reply_pusher.select.select", wait)
        started_s = time.monotonic()
        assert not pusher.push_answer(RESERVE, ReserveResult(BOUND, LOAD), 0.3)
        assert 0.3 <= time.monotonic() - started_s < WAIT_S
        assert locked_while_waiting and not any(locked_while_waiting)
    finally:
        monkeypatch.setattr(pusher, "_sock", real_sock)
        pusher.close()
        listener.close()


# ---- the driver ---------------------------------------------------------------------------------------
def _driver(sent: bool = True) -> SimpleNamespace:
    """What `RouteAndReserve._push_call` / `_on_answer` read of the driver: a listener that takes the send
    (or not), and the calls it was handed."""
    sent_calls: list[RankCall] = []

    def send_call(who: str, call: RankCall) -> bool:
        sent_calls.append(call)
        return sent

    driver = SimpleNamespace(
        _reply_listener=SimpleNamespace(send_call=send_call),
        _pending_calls={},
        _call_ids=itertools.count(1),
        _num_calls_pushed={"reserve": 0, "prefill": 0},
        sent=sent_calls,
    )
    driver._on_answer = lambda *a: RouteAndReserve._on_answer(driver, *a)
    return driver


def _push(driver, who, request, timeout_s=WAIT_S):
    return RouteAndReserve._push_call(driver, who, request, timeout_s)


def _answer(driver, index: int, outcome) -> CallAnswer:
    """The answer to the `index`th call the driver sent, as the listener hands it over."""
    call = driver.sent[index]
    kind = "rsv" if isinstance(call.request, ReserveRequest) else "pf"
    return CallAnswer(call.call_id, kind, call.request.handoff_id, outcome)


def test_the_driver_takes_an_answer_only_for_the_call_and_rank_it_answers() -> None:
    """An answer settles the call of its id sent to the rank that answers; one from another rank, for an
    unknown id, with another kind or handoff than that call's, or for an earlier send of the same handoff
    (a late answer) settles nothing."""

    async def run() -> None:
        driver = _driver()
        first = _push(driver, "decode-0:t", RESERVE_REQUEST, timeout_s=0.05)
        with pytest.raises(asyncio.TimeoutError):  # unanswered in time: the driver gives up on it ...
            await first
        call = _push(driver, "decode-0:t", RESERVE_REQUEST)  # ... and reserves the same handoff again
        prefill_call = _push(driver, "prefill-0:p", PREFILL_REQUEST)
        assert call is not None and driver._num_calls_pushed == {"reserve": 2, "prefill": 1}
        driver._on_answer("decode-0:t", _answer(driver, 0, ReserveResult(BOUND, LOAD)))  # the late one
        driver._on_answer("decode-0:old", _answer(driver, 1, ReserveResult(None, LOAD)))  # another rank
        driver._on_answer("decode-0:t", CallAnswer(99, "rsv", "r@0", ReserveResult(None, LOAD)))  # unknown
        call_id = driver.sent[1].call_id
        driver._on_answer("decode-0:t", CallAnswer(call_id, "pf", "r@0", RESULT))  # not that call's kind
        driver._on_answer("decode-0:t", CallAnswer(call_id, "rsv", "q@0", ReserveResult(None, LOAD)))
        await asyncio.sleep(0)
        assert not call.done() and not prefill_call.done()
        driver._on_answer("decode-0:t", _answer(driver, 1, ReserveResult(None, LOAD)))
        assert await call == ReserveResult(None, LOAD)
        driver._on_answer("prefill-0:p", _answer(driver, 2, RESULT))
        assert await prefill_call == RESULT
        assert driver._pending_calls == {}  # forgotten once answered or given up

        call = _push(driver, "decode-0:t", RESERVE_REQUEST)
        driver._on_answer("decode-0:t", _answer(driver, 3, ValueError("could never fit")))
        with pytest.raises(ValueError, match="could never fit"):
            await call

        call = _push(driver, "decode-0:t", RESERVE_REQUEST)
        driver._on_answer("decode-0:old", None)  # another rank's connection closed
        await asyncio.sleep(0)
        assert not call.done()
        driver._on_answer("decode-0:t", None)
        with pytest.raises(RankConnectionLost, match="^decode-0: its connection to the driver closed"):
            await call
        assert driver._pending_calls == {}

        assert _push(_driver(sent=False), "decode-0:t", RESERVE_REQUEST) is None
        assert _push(driver, None, RESERVE_REQUEST) is None  # the rank has no connection: by Ray
        assert driver._pending_calls == {}

    asyncio.run(run())


def test_rank_connection_lost_counts_as_a_lost_instance() -> None:
    assert RouteAndReserve._is_lost(RankConnectionLost("decode-0:t: its reply connection closed"))
    assert not RouteAndReserve._is_lost(ValueError("could never fit"))
