"""Decode reserves over the driver's reply socket (`orchestrator.reply_channel`): the records
(`orchestrator.reply_records`), the round trip between a `ReplyListener` and a decode rank's `ReplyPusher` in
one process, and how the driver takes the answers (`RouteAndReserve._push_reserve` / `_on_reserved`)."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import time
from types import SimpleNamespace

import pytest

from engine.sampling_params import SamplingParams
from kvtransfer.base import HandoffMeta
from kvtransfer.shm_transport.channel import single_packet
from orchestrator.messages import DecodeNodeLoad, ReserveRequest, ReserveResult
from orchestrator.reply_channel import ReplyListener, ReplyPusher
from orchestrator.reply_records import (
    ReserveRaised,
    reserve_from_record,
    reserve_to_record,
    reserved_from_record,
    reserved_to_record,
)
from orchestrator.router import RankRef
from orchestrator.routing import DecodeConnectionLost, RouteAndReserve

WAIT_S = 10.0  # a bound on one record crossing a local socket and a thread hop on a loaded machine
SECRET = b"k" * 32
META = HandoffMeta("r@0", num_layers=5, num_tokens=3, kv_dim=80, dtype="float32", wire_dtype="float32")
BOUND = dataclasses.replace(META, secret=SECRET)
PARAMS = SamplingParams(
    temperature=0.7, top_p=0.9, top_k=20, seed=2**64 - 1, max_tokens=9, stop_token_ids=[2], stop=["\n\n"],
    logprobs=1,
)  # fmt: skip
REQUEST = ReserveRequest("r@0", (11, 12, 13), PARAMS, META, num_draft_tokens=1)
LOAD = DecodeNodeLoad(
    name="decode-0", pid=4242, num_free_blocks=90, num_total_blocks=128, num_running=2, num_reserved=1,
    num_waiting_for_seat=0, engine_thread_alive=True, num_engine_errors=0, last_engine_error=None,
    ep=None, taken_s=12.5,
)  # fmt: skip


# ---- the records --------------------------------------------------------------------------------------
def test_a_reserve_and_its_answers_survive_their_records() -> None:
    assert reserve_from_record(reserve_to_record(REQUEST)) == REQUEST
    for result in (ReserveResult(BOUND, LOAD), ReserveResult(None, LOAD), ReserveResult(None, None)):
        assert reserved_from_record(reserved_to_record("r@0", result)) == ("r@0", result)
    handoff_id, error = reserved_from_record(reserved_to_record("r@0", ValueError("prompt too long")))
    assert handoff_id == "r@0" and type(error) is ValueError and str(error) == "prompt too long"
    _, error = reserved_from_record(reserved_to_record("r@0", KeyError("x")))
    assert isinstance(error, ReserveRaised) and str(error) == "KeyError: 'x'"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rid": 1}, "string rid"),
        ({"t": []}, "non-empty"),
        ({"t": [1, -2]}, "ints >= 0"),
        ({"t": [1.5]}, "prompt_token_ids is float"),
        ({"n": -1}, "num_draft_tokens is -1"),
        ({"p": {**reserve_to_record(REQUEST)["p"], "temperature": -1}}, "temperature must be"),
        ({"p": {"temperature": 0}}, "sampling parameters"),
        ({"m": {**reserve_to_record(REQUEST)["m"], "request_id": "q@0"}}, "names 'q@0'"),
        ({"m": {**reserve_to_record(REQUEST)["m"], "secret": SECRET}}, "has a secret"),
        ({"m": {**reserve_to_record(REQUEST)["m"], "num_layers": "5"}}, "malformed handoff"),
    ],
)
def test_reserve_from_record_names_what_is_malformed(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        reserve_from_record({**reserve_to_record(REQUEST), **change})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rid": None}, "string rid"),
        ({"err": ["ValueError"]}, "class name, message"),
        ({"m": [1]}, "mappings or nil"),
        ({"m": {**reserved_to_record("r@0", ReserveResult(BOUND))["m"], "secret": b""}}, "no secret"),
        ({"l": {"name": "decode-0"}}, "load fields"),
    ],
)
def test_reserved_from_record_names_what_is_malformed_never_the_secret(change, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        reserved_from_record({**reserved_to_record("r@0", ReserveResult(BOUND, LOAD)), **change})
    assert SECRET.decode() not in str(info.value)


# ---- the socket ---------------------------------------------------------------------------------------
def _answering(result_for):
    """A decode rank's `on_reserve` that answers each reserve with `result_for(request)` at once."""

    def on_reserve(request: ReserveRequest, pusher: ReplyPusher) -> None:
        assert pusher.push_reserved(request.handoff_id, result_for(request), WAIT_S)

    return on_reserve


def _send_reserve_once_registered(listener: ReplyListener, who: str, request: ReserveRequest) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while not listener.send_reserve(who, request):
        assert time.monotonic() < deadline_s, f"no connection of {who} registered in {WAIT_S} s"
        time.sleep(0.01)


def test_a_reserve_reaches_its_decode_rank_only_and_its_answer_comes_back_under_its_tag() -> None:
    """A reserve goes whole to the decode connection whose hello named the tag and said it takes reserves,
    never to a prefill connection, a decode one that takes none, or an unknown tag; the answer (the bound
    meta with its secret, the load; or the error) reaches `on_reserved` under that tag. A second connection
    under the tag gets none and its answers are dropped. When the rank's connection closes, `on_reserved`
    hears it (None), and no reserve is sent there any more."""
    answers: queue.Queue = queue.Queue()
    listener = ReplyListener(lambda *r: None, lambda *e: None, lambda *a: answers.put(a))
    taken: queue.Queue = queue.Queue()
    pushers = []

    def result_for(request: ReserveRequest):
        taken.put(request)
        if request.handoff_id == "bad@0":
            return ValueError("could never fit")
        return ReserveResult(dataclasses.replace(request.meta, secret=SECRET), LOAD)

    try:
        decode = ReplyPusher(
            listener.address, listener.secret, "decode-0:a", on_reserve=_answering(result_for)
        )
        silent = ReplyPusher(listener.address, listener.secret, "decode-1:b")  # takes no reserves
        prefill = ReplyPusher(listener.address, listener.secret, "prefill-0:c", on_bind=lambda b: None)
        pushers += [decode, silent, prefill]
        _send_reserve_once_registered(listener, "decode-0:a", REQUEST)
        assert taken.get(timeout=WAIT_S) == REQUEST
        assert answers.get(timeout=WAIT_S) == ("decode-0:a", "r@0", ReserveResult(BOUND, LOAD))
        bad = dataclasses.replace(
            REQUEST, handoff_id="bad@0", meta=dataclasses.replace(META, request_id="bad@0")
        )
        assert listener.send_reserve("decode-0:a", bad)
        assert taken.get(timeout=WAIT_S) == bad
        who, handoff_id, error = answers.get(timeout=WAIT_S)
        assert (who, handoff_id, type(error), str(error)) == (
            "decode-0:a",
            "bad@0",
            ValueError,
            "could never fit",
        )
        for other in ("decode-1:b", "prefill-0:c", "nobody"):
            assert not listener.send_reserve(other, REQUEST)
        second = ReplyPusher(
            listener.address, listener.secret, "decode-0:a", on_reserve=_answering(result_for)
        )
        pushers.append(second)
        # it was sent no reserve: its answer is dropped by the listener
        assert second.push_reserved("r@0", ReserveResult(BOUND, LOAD), WAIT_S)
        assert decode.num_reserves_received == 2 and second.num_reserves_received == 0
        decode.close()
        assert answers.get(timeout=WAIT_S) == ("decode-0:a", None, None)
        assert answers.empty() and taken.empty()
        assert not listener.is_registered("decode-0:a")  # the second connection does not inherit the tag
    finally:
        for pusher in pushers:
            pusher.close()
        listener.close()


def test_a_malformed_reserve_from_the_driver_is_dropped_and_the_reserves_go_on(caplog) -> None:
    answers: queue.Queue = queue.Queue()
    listener = ReplyListener(lambda *r: None, None, lambda *a: answers.put(a))
    decode = ReplyPusher(
        listener.address,
        listener.secret,
        "decode-0:a",
        on_reserve=_answering(lambda r: ReserveResult(None, LOAD)),
    )
    try:
        _send_reserve_once_registered(listener, "decode-0:a", REQUEST)
        assert answers.get(timeout=WAIT_S) == ("decode-0:a", "r@0", ReserveResult(None, LOAD))
        sock = listener._registered["decode-0:a"].sock
        sock.send(single_packet({**reserve_to_record(REQUEST), "t": []}))
        assert listener.send_reserve("decode-0:a", REQUEST)
        assert answers.get(timeout=WAIT_S) == ("decode-0:a", "r@0", ReserveResult(None, LOAD))
        assert decode.num_reserves_received == 2
        assert any("malformed record from the driver" in r.getMessage() for r in caplog.records)
    finally:
        decode.close()
        listener.close()


def test_an_answer_that_finds_no_room_waits_then_gives_up_without_blocking_the_pushes(monkeypatch) -> None:
    """`push_reserved` waits for room in the driver's buffer up to its bound, outside the lock the engine
    thread's event pushes take; past the bound it says False (the decode rank then releases the
    reservation)."""
    listener = ReplyListener(lambda *r: None)
    pusher = ReplyPusher(listener.address, listener.secret, "decode-0:a", on_reserve=lambda r, p: None)
    try:

        class Full:
            def send(self, packet):
                raise BlockingIOError

            def fileno(self):
                return pusher_sock.fileno()

        pusher_sock = pusher._sock
        monkeypatch.setattr(pusher, "_sock", Full())
        monkeypatch.setattr(
            "orchestrator.reply_channel.select.select", lambda r, w, x, t: time.sleep(t) or ([], [], [])
        )
        started_s = time.monotonic()
        assert not pusher.push_reserved("r@0", ReserveResult(BOUND, LOAD), 0.3)
        assert 0.3 <= time.monotonic() - started_s < WAIT_S
        assert not pusher._lock.locked()
        monkeypatch.setattr(pusher, "_sock", pusher_sock)
    finally:
        pusher.close()
        listener.close()


# ---- the driver ---------------------------------------------------------------------------------------
def _driver(sent: bool = True) -> SimpleNamespace:
    """What `RouteAndReserve._push_reserve` / `_on_reserved` read of the driver: decode-0 rank 0 under tag
    `decode-0:t`, a listener that takes the send (or not)."""
    driver = SimpleNamespace(
        _reply_listener=SimpleNamespace(send_reserve=lambda who, request: sent),
        _decode_push_tags={"decode-0:old": RankRef(1, 0), "decode-0:t": RankRef(0, 0)},
        _pending_reserves={},
        _num_reserves_pushed=0,
        call_timeout_s=WAIT_S,
    )
    driver._on_reserved = lambda *a: RouteAndReserve._on_reserved(driver, *a)
    return driver


def test_the_driver_takes_an_answer_only_from_the_rank_it_sent_the_reserve_to() -> None:
    async def run() -> None:
        driver = _driver()
        call = RouteAndReserve._push_reserve(driver, RankRef(0, 0), REQUEST)
        assert call is not None and driver._num_reserves_pushed == 1
        assert driver._pending_reserves["r@0"][0] == "decode-0:t"
        driver._on_reserved("decode-0:old", "r@0", ReserveResult(None, LOAD))  # another rank's: dropped
        driver._on_reserved("decode-0:t", "q@0", ReserveResult(None, LOAD))  # no such reserve: dropped
        await asyncio.sleep(0)
        assert not call.done()
        driver._on_reserved("decode-0:t", "r@0", ReserveResult(BOUND, LOAD))
        assert await call == ReserveResult(BOUND, LOAD)
        assert driver._pending_reserves == {}  # forgotten once answered

        call = RouteAndReserve._push_reserve(driver, RankRef(0, 0), REQUEST)
        driver._on_reserved("decode-0:t", "r@0", ValueError("could never fit"))
        with pytest.raises(ValueError, match="could never fit"):
            await call

        call = RouteAndReserve._push_reserve(driver, RankRef(0, 0), REQUEST)
        driver._on_reserved("decode-0:old", None, None)  # another rank's connection closed
        await asyncio.sleep(0)
        assert not call.done()
        driver._on_reserved("decode-0:t", None, None)
        with pytest.raises(DecodeConnectionLost, match="decode-0:t"):
            await call
        assert driver._pending_reserves == {}

        assert RouteAndReserve._push_reserve(_driver(sent=False), RankRef(0, 0), REQUEST) is None
        assert RouteAndReserve._push_reserve(driver, RankRef(2, 0), REQUEST) is None  # no tag: by Ray

    asyncio.run(run())


def test_an_unanswered_reserve_times_out_at_the_call_bound() -> None:
    async def run() -> None:
        driver = _driver()
        driver.call_timeout_s = 0.05
        call = RouteAndReserve._push_reserve(driver, RankRef(0, 0), REQUEST)
        with pytest.raises(asyncio.TimeoutError):
            await call
        assert driver._pending_reserves == {}
        driver._on_reserved("decode-0:t", "r@0", ReserveResult(BOUND, LOAD))  # a late answer: nothing waits

    asyncio.run(run())
