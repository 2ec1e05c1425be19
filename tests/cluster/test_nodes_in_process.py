"""The prefill and decode rank actors as plain objects in this process (no Ray): a handoff over the gRPC
transport on loopback and over the shm transport (each test runs on both), typed loads and events, poll
acknowledgement, a handoff that never comes (its lease expires), and the shared engine-thread scaffolding
(fault injection, loop-error accounting)."""

from __future__ import annotations

import time

import pytest

from pdcluster.driver.command_order import CommandSeq
from pdcluster.driver.messages import (
    DecodeNodeLoad,
    PrefillFirstToken,
    PrefillNodeLoad,
    PrefillRequest,
    PrefillResult,
    RequestError,
    ReserveRequest,
    TokenDelta,
)
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kvtransfer.base import HandoffMeta
from pdcluster.workers.decode import DecodeWorker
from pdcluster.workers.thread_clock import run_delay_s
from tests.cluster.test_cluster import _topology
from tests.faults import FaultyDecodeWorker, FaultyPrefillWorker

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = tuple(range(10, 50))  # 40 tokens
EVENT_WAIT_S = 30.0  # a generous bound on a tiny model's prefill + 6 decode steps on a shared CPU


@pytest.fixture(scope="module", params=["grpc", "shm"])
def nodes(request):
    topo = _topology(k=1)
    decode = FaultyDecodeWorker(topo.engine_config("decode"), "decode-0")
    prefill = FaultyPrefillWorker(topo.engine_config("prefill"), "prefill-0", layerwise=True)
    address = decode.start_receiver(request.param)
    prefill.connect_receivers(request.param, [[address]])
    yield prefill, decode
    prefill.close()
    decode.close()


def _meta(prefill, handoff_id: str, lease_s: float = 20.0) -> HandoffMeta:
    cfg = prefill.engine.model.config
    return HandoffMeta(
        request_id=handoff_id,
        num_layers=cfg.num_hidden_layers + 1,  # + the MTP layer (k=1)
        num_tokens=len(PROMPT),
        kv_dim=cfg.kv_cache_dim,
        dtype=prefill.engine.config.dtype,
        wire_dtype=prefill.engine.config.dtype,
        lease_s=lease_s,
    )


def _events_until(decode, handoff_id: str, done, acked_seq: int = 0) -> tuple[list, int]:
    """Poll (acknowledging) until `done(event)` for an event of `handoff_id`; its events and the last seq."""
    events, deadline_s = [], time.monotonic() + EVENT_WAIT_S
    while time.monotonic() < deadline_s:
        for polled in decode.poll(0.05, acked_seq):
            acked_seq = polled.seq
            if polled.event.handoff_id == handoff_id:
                events.append(polled.event)
                if done(polled.event):
                    return events, acked_seq
    raise AssertionError(f"no final event for {handoff_id} within {EVENT_WAIT_S} s: {events}")


def _replies(prefill, request: PrefillRequest, order: CommandSeq | None = None):
    """`PrefillWorker.prefill`'s two replies: (its `PrefillFirstToken`, its `PrefillResult`)."""
    first, result = prefill.prefill(request, order)
    assert isinstance(first, PrefillFirstToken) and isinstance(result, PrefillResult)
    assert first.first_token_id == result.first_token_id
    return first, result


def _prefill(prefill, request: PrefillRequest, order: CommandSeq | None = None) -> PrefillResult:
    return _replies(prefill, request, order)[1]


def _assert_idle(prefill, decode) -> None:
    assert prefill.check_no_leaks() == {"num_used_blocks": 0, "num_active": 0, "pending_handoffs": []}
    assert decode.check_no_leaks() == {
        "num_used_blocks": 0,
        "num_reserved": 0,
        "num_unfinished": 0,
        "pending_handoffs": [],
    }


def test_a_handoff_end_to_end_with_typed_messages(nodes) -> None:
    prefill, decode = nodes
    free_before = decode.load().num_free_blocks
    reserve = ReserveRequest("h1", PROMPT, GREEDY, _meta(prefill, "h1"), num_draft_tokens=1)
    reserved = decode.reserve(reserve)
    assert reserved.reserved and reserved.bound_meta.secret  # bound, with the handoff's secret
    load = decode.load()
    assert isinstance(load, DecodeNodeLoad) and load.num_reserved == 1 and load.batch_load == 1
    assert load.num_free_blocks < free_before and load.engine_thread_alive

    result = _prefill(prefill, PrefillRequest("h1", PROMPT, GREEDY, reserved.bound_meta, decode_index=0))
    assert isinstance(result, PrefillResult) and result.num_drafts == 1
    assert result.queue_s >= 0 and result.prefill_s > 0
    events, _ = _events_until(decode, "h1", lambda e: isinstance(e, RequestError) or e.finished)
    assert all(isinstance(e, TokenDelta) for e in events), events
    first, last = events[0], events[-1]
    assert first.new_token_ids == () and first.new_text == ""  # the first token's one source: prefill's reply
    assert first.phases.kv_transfer_s is not None and first.phases.kv_transfer_s >= 0
    assert isinstance(first.kv_transfer_bytes, int) and first.kv_transfer_bytes > 0
    stepped = events[1]  # the first stepped delta measures the first decode step
    assert stepped.phases.first_decode_step_s is not None
    assert stepped.kv_transfer_bytes == first.kv_transfer_bytes
    assert sum(len(e.new_token_ids) for e in events) == GREEDY.max_tokens - 1
    assert last.finished and last.finish_reason == "length"
    assert all(not e.finished and e.finish_reason is None for e in events[:-1])
    assert last.drafts.num_accepted_tokens <= last.drafts.num_draft_tokens
    assert len(last.drafts.num_draft_tokens_per_position) == 1
    prefill_load = prefill.load()
    assert isinstance(prefill_load, PrefillNodeLoad)
    assert prefill_load.num_queued_prefill_tokens == 0 and prefill_load.num_requests == 0
    _assert_idle(prefill, decode)


def test_decode_streams_the_first_token_when_it_may_not_go_early(nodes) -> None:
    """With stop strings the first token's text is decode's to release (`early_first_token_text` is
    None): prefill's reply carries no text and decode's admission delta carries the token, once; without
    them prefill's reply is its one source and decode's deltas leave it out."""
    prefill, decode = nodes
    stopped = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["never in the output"])
    reserved = decode.reserve(ReserveRequest("s1", PROMPT, stopped, _meta(prefill, "s1"), 1))
    first, _ = _replies(prefill, PrefillRequest("s1", PROMPT, stopped, reserved.bound_meta, 0))
    assert first.first_token_text is None
    events, _ = _events_until(decode, "s1", lambda e: isinstance(e, RequestError) or e.finished)
    assert events[0].new_token_ids == (first.first_token_id,)
    assert len(_tokens(events)) == stopped.max_tokens
    _assert_idle(prefill, decode)


def test_a_first_token_the_client_has_replaces_the_sampled_one(nodes) -> None:
    """A re-dispatch after the first token streamed from an earlier prefill reply
    (`PrefillRequest.first_token_id`): the prefill hands decode that token instead of the one it samples,
    without the drafts it proposed after its own (and without streaming it again: no first_token_text);
    decode's tokens after it are one engine's greedy continuation of the prompt plus that token."""
    from pdcluster.engine.llm import LLM
    from pdcluster.models import bundled_checkpoint_dir

    prefill, decode = nodes
    reserved = decode.reserve(ReserveRequest("f0", PROMPT, GREEDY, _meta(prefill, "f0"), 1))
    sampled, _ = _replies(prefill, PrefillRequest("f0", PROMPT, GREEDY, reserved.bound_meta, 0))
    assert sampled.first_token_text is not None  # greedy, no stop strings: it may go early
    _events_until(decode, "f0", lambda e: isinstance(e, RequestError) or e.finished)
    given = (sampled.first_token_id + 1) % prefill.engine.model.config.vocab_size
    reserved = decode.reserve(ReserveRequest("f1", PROMPT, GREEDY, _meta(prefill, "f1"), 1))
    first, result = _replies(
        prefill, PrefillRequest("f1", PROMPT, GREEDY, reserved.bound_meta, 0, first_token_id=given)
    )
    assert (result.first_token_id, result.num_drafts, first.first_token_text) == (given, 0, None)
    events, _ = _events_until(decode, "f1", lambda e: isinstance(e, RequestError) or e.finished)
    assert all(isinstance(e, TokenDelta) for e in events), events
    tokens = [t for e in events for t in e.new_token_ids]
    oracle = LLM(bundled_checkpoint_dir(), num_kv_blocks=64)
    rest = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens - 1, ignore_eos=True)
    assert tokens == oracle.generate([[*PROMPT, given]], rest)[0].token_ids  # the client has `given`
    _assert_idle(prefill, decode)


def test_poll_keeps_events_until_acknowledged(nodes) -> None:
    prefill, decode = nodes
    retained = decode.poll(0.0, 0)
    if retained:  # acknowledge what earlier tests left
        decode.poll(0.0, retained[-1].seq)
    reserved = decode.reserve(ReserveRequest("h2", PROMPT, GREEDY, _meta(prefill, "h2"), 1))
    _prefill(prefill, PrefillRequest("h2", PROMPT, GREEDY, reserved.bound_meta, 0))
    deadline_s = time.monotonic() + EVENT_WAIT_S
    unacked = decode.poll(0.05, 0)
    while not (unacked and unacked[-1].event.finished):  # never acknowledged: every poll repeats them
        assert time.monotonic() < deadline_s, unacked
        time.sleep(0.01)  # such a poll returns at once: a loop without a pause starves the engine thread
        unacked = decode.poll(0.05, 0)
    assert decode.poll(0.0, 0) == unacked  # a reply lost to a timeout is sent again
    assert [p.seq for p in unacked] == list(range(unacked[0].seq, unacked[0].seq + len(unacked)))
    assert sum(len(p.event.new_token_ids) for p in unacked) == GREEDY.max_tokens - 1
    assert decode.poll(0.0, unacked[-2].seq) == unacked[-1:]  # acknowledged ones are dropped
    assert decode.poll(0.0, unacked[-1].seq) == []
    _assert_idle(prefill, decode)


def test_a_handoff_that_never_comes_is_an_error_event_and_frees_the_reservation(nodes) -> None:
    prefill, decode = nodes
    reserved = decode.reserve(ReserveRequest("h3", PROMPT, GREEDY, _meta(prefill, "h3", lease_s=0.5), 1))
    assert reserved.reserved and decode.load().num_reserved == 1
    events, _ = _events_until(decode, "h3", lambda e: isinstance(e, RequestError))
    assert len(events) == 1 and events[0].handoff_id == "h3" and events[0].message
    _assert_idle(prefill, decode)


def test_an_injected_prefill_fault_fails_that_request_and_is_counted(nodes) -> None:
    prefill, decode = nodes
    with pytest.raises(ValueError, match="unknown fault point 'admit'"):
        prefill.inject_fault("admit")  # a decode fault point, not a prefill one
    errors_before = prefill.load().num_engine_errors
    reserved = decode.reserve(ReserveRequest("h4", PROMPT, GREEDY, _meta(prefill, "h4"), 1))
    prefill.inject_fault("start")
    with pytest.raises(RuntimeError, match="prefill of h4 failed: RuntimeError.'injected fault at start'"):
        _prefill(prefill, PrefillRequest("h4", PROMPT, GREEDY, reserved.bound_meta, 0))
    load = prefill.load()
    assert load.num_engine_errors == errors_before + 1 and load.engine_thread_alive
    assert load.last_engine_error == "starting h4 failed: RuntimeError('injected fault at start')"
    decode.abort("h4")  # the driver releases the failed attempt
    _assert_idle(prefill, decode)


def test_an_injected_decode_fault_is_an_error_event_and_the_loop_survives(nodes) -> None:
    prefill, decode = nodes
    errors_before = decode.load().num_engine_errors
    decode.inject_fault("delta")
    reserved = decode.reserve(ReserveRequest("h5", PROMPT, GREEDY, _meta(prefill, "h5"), 1))
    _prefill(prefill, PrefillRequest("h5", PROMPT, GREEDY, reserved.bound_meta, 0))
    events, _ = _events_until(decode, "h5", lambda e: isinstance(e, RequestError))
    assert events[-1].message == "decode output failed: RuntimeError('injected fault at delta')"
    load = decode.load()
    assert load.num_engine_errors == errors_before + 1 and load.engine_thread_alive
    _assert_idle(prefill, decode)


def test_a_stalled_engine_pass_shows_in_the_load_and_the_loop_goes_on(nodes) -> None:
    """The engine watchdog's inputs (`engine_passes`, `engine_pass_s`): while an engine thread hangs in one
    pass (inject_stall), its count stands still and the pass's seconds grow, and `load` still answers;
    released, the loop passes again and a handoff is served."""
    prefill, decode = nodes
    for node in (prefill, decode):
        node.inject_stall(EVENT_WAIT_S)
        try:
            deadline_s = time.monotonic() + EVENT_WAIT_S
            while (stalled := node.load()).engine_pass_s < 0.2:
                assert time.monotonic() < deadline_s, f"{node.name}: the stall never showed"
                time.sleep(0.01)
            time.sleep(0.1)
            later = node.load()
            assert later.engine_passes == stalled.engine_passes and later.engine_thread_alive
            assert later.engine_pass_s >= stalled.engine_pass_s + 0.1
        finally:
            node.release_stall()
        deadline_s = time.monotonic() + EVENT_WAIT_S
        while (after := node.load()).engine_passes == stalled.engine_passes:
            assert time.monotonic() < deadline_s, f"{node.name}: the loop did not pass again"
            time.sleep(0.01)
        assert after.engine_pass_s < EVENT_WAIT_S
    reserved = decode.reserve(ReserveRequest("h-stall", PROMPT, GREEDY, _meta(prefill, "h-stall"), 1))
    _prefill(prefill, PrefillRequest("h-stall", PROMPT, GREEDY, reserved.bound_meta, 0))
    events, _ = _events_until(decode, "h-stall", lambda e: isinstance(e, RequestError) or e.finished)
    assert all(isinstance(e, TokenDelta) for e in events), events
    assert sum(len(e.new_token_ids) for e in events) == GREEDY.max_tokens - 1
    _assert_idle(prefill, decode)


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.new_token_ids]


def test_a_prefill_sent_before_its_reservation_hands_off_once_bound(nodes) -> None:
    """The driver's overlap (`PrefillRequest.awaiting_bind`): prefill computes before decode has reserved,
    holds the prompt's KV, and hands it off when the bind comes; a bind call that overtakes its prefill
    call waits for its turn (`driver.command_order`). Greedy tokens equal those of the reserve-first
    handoff; nothing stays held."""
    import threading

    from pdcluster.driver.messages import PrefillBind

    prefill, decode = nodes

    def reserve(handoff_id: str):
        reserved = decode.reserve(ReserveRequest(handoff_id, PROMPT, GREEDY, _meta(prefill, handoff_id), 1))
        assert reserved.reserved
        assert reserved.load is not None and reserved.load.num_reserved == 1  # the piggy-backed load
        return reserved.bound_meta

    def until_done(handoff_id: str, acked: int) -> tuple[list[int], int]:
        events, acked = _events_until(
            decode, handoff_id, lambda e: isinstance(e, RequestError) or e.finished, acked
        )
        assert all(isinstance(e, TokenDelta) for e in events), events
        return _tokens(events), acked

    bound = reserve("ref")
    _prefill(prefill, PrefillRequest("ref", PROMPT, GREEDY, bound, decode_index=0))
    expected, acked = until_done("ref", 0)
    assert len(expected) == GREEDY.max_tokens - 1  # the first token is prefill's reply's

    # Prefill first: its call blocks (no reservation yet) until the bind.
    results: list = []
    request = PrefillRequest(
        "late", PROMPT, GREEDY, _meta(prefill, "late"), decode_index=0, awaiting_bind=True
    )
    caller = threading.Thread(target=lambda: results.append(_prefill(prefill, request)))
    caller.start()
    deadline_s = time.monotonic() + EVENT_WAIT_S
    while prefill.load().num_requests == 0:  # taken by the engine thread
        assert time.monotonic() < deadline_s
        time.sleep(0.01)
    caller.join(0.5)
    assert caller.is_alive() and not results  # prefilled (or prefilling), waiting for its bind
    assert decode.poll(0.0, acked) == []  # nothing reached decode
    prefill.bind(PrefillBind("late", reserve("late"), decode_index=0))
    caller.join(EVENT_WAIT_S)
    assert len(results) == 1 and isinstance(results[0], PrefillResult)
    tokens, acked = until_done("late", acked)
    assert tokens == expected

    # The bind's call overtakes the prefill call (Ray runs a threaded actor's calls unordered): it waits
    # for its turn in the driver's command stream, then binds.
    bind = PrefillBind("early", reserve("early"), decode_index=0)
    binder = threading.Thread(target=prefill.bind, args=(bind, CommandSeq("bind-overtakes", 2)))
    binder.start()
    binder.join(0.3)
    assert binder.is_alive()  # waiting for command 1
    request = PrefillRequest(
        "early", PROMPT, GREEDY, _meta(prefill, "early"), decode_index=0, awaiting_bind=True
    )
    assert isinstance(_prefill(prefill, request, CommandSeq("bind-overtakes", 1)), PrefillResult)
    binder.join(EVENT_WAIT_S)
    tokens, acked = until_done("early", acked)
    assert tokens == expected
    _assert_idle(prefill, decode)


BIND_AT_LAYER = 2  # the bind comes once layers 0 and 1 are computed (held, not sent: no handoff yet)


def _deliver_bind_at_layer(prefill, monkeypatch, handoff_id: str, bind) -> None:
    """Deliver `bind` the way a late one comes: from another thread's `bind()` while the step runs, here
    just before the prompt KV of layer `BIND_AT_LAYER` is handed over."""
    real_on_prompt_kv = prefill._on_prompt_kv

    def on_prompt_kv(request_id, layer_idx, latent_kv, scale):
        if request_id == handoff_id and layer_idx == BIND_AT_LAYER:
            prefill.bind(bind)
        real_on_prompt_kv(request_id, layer_idx, latent_kv, scale)

    monkeypatch.setattr(prefill, "_on_prompt_kv", on_prompt_kv)


def _reference_tokens(prefill, decode, handoff_id: str) -> tuple[list[int], int]:
    reserved = decode.reserve(ReserveRequest(handoff_id, PROMPT, GREEDY, _meta(prefill, handoff_id), 1))
    _prefill(prefill, PrefillRequest(handoff_id, PROMPT, GREEDY, reserved.bound_meta, decode_index=0))
    events, acked = _events_until(decode, handoff_id, lambda e: isinstance(e, RequestError) or e.finished)
    assert all(isinstance(e, TokenDelta) for e in events), events
    return _tokens(events), acked


def test_the_first_reply_leaves_as_the_token_is_sampled_before_the_rest_of_the_step(
    nodes, monkeypatch
) -> None:
    """`prefill` yields its first reply as the token is sampled: with the engine thread held right after
    sampling (before the last layer's KV send and the MTP pass over the prompt), the first reply comes and
    the last does not; let go, the last reply and decode's tokens are the reserve-first handoff's."""
    import threading

    prefill, decode = nodes
    expected, acked = _reference_tokens(prefill, decode, "ref-first")
    held, release, real_first_token = threading.Event(), threading.Event(), prefill.handover.first_token

    def first_token(request_id: str, token_id: int) -> None:
        real_first_token(request_id, token_id)
        if request_id == "first":
            held.set()
            release.wait(EVENT_WAIT_S)

    monkeypatch.setattr(prefill.handover, "first_token", first_token)
    reserved = decode.reserve(ReserveRequest("first", PROMPT, GREEDY, _meta(prefill, "first"), 1))
    replies = prefill.prefill(PrefillRequest("first", PROMPT, GREEDY, reserved.bound_meta, decode_index=0))
    try:
        first = next(replies)
        assert held.is_set() and not release.is_set()  # came while the engine thread was held
        job = prefill._active["first"]
        assert not job.done.is_set() and job.num_layers_sent < reserved.bound_meta.num_layers
    finally:
        release.set()
    result = next(replies)
    monkeypatch.undo()
    assert isinstance(first, PrefillFirstToken) and first.first_token_text is not None
    assert first.queue_s is not None and 0.0 <= first.queue_s <= result.queue_s + result.prefill_s
    assert isinstance(result, PrefillResult) and result.first_token_id == first.first_token_id
    assert result.num_drafts == 1  # the MTP pass ran after the first reply
    events, _ = _events_until(decode, "first", lambda e: isinstance(e, RequestError) or e.finished, acked)
    assert all(isinstance(e, TokenDelta) for e in events), events
    assert _tokens(events) == expected
    _assert_idle(prefill, decode)


def test_a_prefill_that_fails_after_its_first_reply_raises_on_its_last(nodes) -> None:
    """The hand-over after the first token fails (an injected fault at "complete"): the call's first reply
    came, its last raises with the cause, decode's reservation ends in an error event (the handoff was
    aborted), and nothing stays held."""
    prefill, decode = nodes
    reserved = decode.reserve(ReserveRequest("late-fail", PROMPT, GREEDY, _meta(prefill, "late-fail"), 1))
    prefill.inject_fault("complete")
    replies = prefill.prefill(PrefillRequest("late-fail", PROMPT, GREEDY, reserved.bound_meta, 0))
    assert isinstance(next(replies), PrefillFirstToken)
    with pytest.raises(RuntimeError, match="prefill of late-fail failed: .*injected fault at complete"):
        next(replies)
    events, _ = _events_until(decode, "late-fail", lambda e: isinstance(e, RequestError))
    assert "injected fault at complete" in events[-1].message, events
    decode.abort("late-fail")  # the driver releases the failed attempt
    deadline_s = time.monotonic() + EVENT_WAIT_S
    while prefill.check_no_leaks()["pending_handoffs"]:  # the sender forgets it once its stream closed
        assert time.monotonic() < deadline_s, prefill.check_no_leaks()
        time.sleep(0.01)
    _assert_idle(prefill, decode)


def test_a_bind_that_comes_during_the_prefill_step_streams_the_layers_before_the_step_ends(
    nodes, monkeypatch
) -> None:
    """A bind that arrives while its request's prefill step runs is taken at the step's next layer: the
    handoff begins there, the layers held until then go out in order, and every layer is sent before the
    step returns (not buffered until after it, which delayed the first token by the handoff's begin and
    sends); tokens equal the reserve-first handoff's."""
    from pdcluster.driver.messages import PrefillBind

    prefill, decode = nodes
    expected, acked = _reference_tokens(prefill, decode, "ref-mid")
    bound = decode.reserve(ReserveRequest("mid", PROMPT, GREEDY, _meta(prefill, "mid"), 1)).bound_meta
    _deliver_bind_at_layer(prefill, monkeypatch, "mid", PrefillBind("mid", bound, decode_index=0))
    engine, real_step, sent_when_step_returned = prefill.engine, prefill.engine.step, []

    def step(*args, **kwargs):
        job = prefill._active.get("mid")
        outputs = real_step(*args, **kwargs)
        if job is not None:
            sent_when_step_returned.append(job.num_layers_sent)
        return outputs

    monkeypatch.setattr(engine, "step", step)
    request = PrefillRequest("mid", PROMPT, GREEDY, _meta(prefill, "mid"), decode_index=0, awaiting_bind=True)
    result = _prefill(prefill, request)
    monkeypatch.undo()
    assert isinstance(result, PrefillResult)
    if run_delay_s() is not None:  # the engine thread's wait for a CPU: part of the prefill time
        assert result.cpu_wait_s is not None
        assert 0.0 <= result.cpu_wait_s <= result.queue_s + result.prefill_s
    assert sent_when_step_returned == [bound.num_layers]  # one step; all layers out before it returned
    events, _ = _events_until(decode, "mid", lambda e: isinstance(e, RequestError) or e.finished, acked)
    assert all(isinstance(e, TokenDelta) for e in events), events
    assert _tokens(events) == expected
    _assert_idle(prefill, decode)


def test_a_handoff_that_cannot_begin_mid_step_fails_alone(nodes, monkeypatch) -> None:
    """Two requests prefill in one step; the bind of one comes mid-step and its sender's `begin` raises:
    that request's prefill call fails with the cause, the other one's handoff completes with the reference
    tokens, and nothing stays held (failing it inside the step freed engine state the step still used,
    which failed every request in the step)."""
    import threading

    from pdcluster.driver.messages import PrefillBind

    prefill, decode = nodes
    expected, acked = _reference_tokens(prefill, decode, "ref-fail")
    good = decode.reserve(ReserveRequest("good", PROMPT, GREEDY, _meta(prefill, "good"), 1)).bound_meta
    bad = decode.reserve(ReserveRequest("bad", PROMPT, GREEDY, _meta(prefill, "bad"), 1)).bound_meta
    _deliver_bind_at_layer(prefill, monkeypatch, "bad", PrefillBind("bad", bad, decode_index=0))
    sender = prefill.senders[0][0]
    real_begin, real_start = sender.begin, prefill._start

    def begin(meta):
        if meta.request_id == "bad":
            raise ConnectionError("injected: the receiver is unreachable")
        real_begin(meta)

    good_taken = threading.Event()

    def start(job):  # the first job starts once the second is queued behind it: both run in one step
        if job.request_id == "good":
            good_taken.set()
            deadline_s = time.monotonic() + EVENT_WAIT_S
            while prefill._jobs.qsize() == 0:
                assert time.monotonic() < deadline_s
                time.sleep(0.005)
        real_start(job)

    monkeypatch.setattr(sender, "begin", begin)
    monkeypatch.setattr(prefill, "_start", start)
    results: dict[str, object] = {}

    def call(request: PrefillRequest) -> None:
        try:
            results[request.handoff_id] = _prefill(prefill, request)
        except RuntimeError as e:
            results[request.handoff_id] = e

    first = threading.Thread(
        target=call, args=(PrefillRequest("good", PROMPT, GREEDY, good, decode_index=0),)
    )
    first.start()
    assert good_taken.wait(EVENT_WAIT_S)  # "bad" is queued after it
    bad_request = PrefillRequest(
        "bad", PROMPT, GREEDY, _meta(prefill, "bad"), decode_index=0, awaiting_bind=True
    )
    second = threading.Thread(target=call, args=(bad_request,))
    second.start()
    first.join(EVENT_WAIT_S)
    second.join(EVENT_WAIT_S)
    monkeypatch.undo()
    assert isinstance(results["good"], PrefillResult), results
    assert isinstance(results["bad"], RuntimeError) and "injected: the receiver is unreachable" in str(
        results["bad"]
    )
    events, _ = _events_until(decode, "good", lambda e: isinstance(e, RequestError) or e.finished, acked)
    assert all(isinstance(e, TokenDelta) for e in events), events
    assert _tokens(events) == expected
    decode.abort("bad")  # its reservation: the driver releases it when the prefill call fails
    _assert_idle(prefill, decode)


def test_a_prefill_awaiting_its_bind_is_aborted_cleanly(nodes) -> None:
    """No room on decode in the end: the driver aborts the prefill that awaited its bind; its call raises
    and nothing stays held on either side."""
    import threading

    prefill, decode = nodes
    errors: list = []
    request = PrefillRequest(
        "gone", PROMPT, GREEDY, _meta(prefill, "gone"), decode_index=0, awaiting_bind=True
    )

    def call() -> None:
        try:
            _prefill(prefill, request)
        except RuntimeError as e:
            errors.append(str(e))

    caller = threading.Thread(target=call)
    caller.start()
    deadline_s = time.monotonic() + EVENT_WAIT_S
    while prefill.load().num_requests == 0:
        assert time.monotonic() < deadline_s
        time.sleep(0.01)
    prefill.abort("gone")
    caller.join(EVENT_WAIT_S)
    assert len(errors) == 1 and "aborted by the router" in errors[0]
    _assert_idle(prefill, decode)


def test_an_abort_that_overtakes_its_prefill_call_waits_for_it_then_fails_it(nodes) -> None:
    """Ray runs a threaded actor's calls unordered: the driver's abort may come before the prefill call it
    aborts. It waits for its turn in the command stream, so the prefill is queued first and then fails
    with the abort, without awaiting a bind that never comes; nothing stays held."""
    import threading

    prefill, decode = nodes
    aborter = threading.Thread(target=prefill.abort, args=("overtaken", CommandSeq("abort-overtakes", 2)))
    aborter.start()
    request = PrefillRequest(
        "overtaken", PROMPT, GREEDY, _meta(prefill, "overtaken"), decode_index=0, awaiting_bind=True
    )
    with pytest.raises(RuntimeError, match="aborted by the router"):
        _prefill(prefill, request, CommandSeq("abort-overtakes", 1))
    aborter.join(EVENT_WAIT_S)
    assert prefill.load().num_requests == 0
    _assert_idle(prefill, decode)


def test_a_reserve_is_served_while_a_decode_step_executes(nodes, monkeypatch) -> None:
    """The engine thread lets reserves in while its step's forward runs (`LLMEngine.step`'s
    `while_executing`): with a step held inside `Executor.execute`, a reserve returns bound at once (it used
    to wait for the step's end under the engine lock), on blocks disjoint from the held step's, while an
    abort, which may free a running request's blocks, still waits for the step. Once the held step is older
    than half the reserve's call timeout (`driver.dispatch.call_timeout_s` of its lease) a reserve
    waits for it too, so a hung step still makes reserves time out. The held request's tokens equal those of
    an undisturbed handoff, and nothing stays held."""
    import threading

    from pdcluster.driver.dispatch import call_timeout_s

    prefill, decode = nodes

    def handoff(handoff_id: str) -> None:
        reserved = decode.reserve(ReserveRequest(handoff_id, PROMPT, GREEDY, _meta(prefill, handoff_id), 1))
        _prefill(prefill, PrefillRequest(handoff_id, PROMPT, GREEDY, reserved.bound_meta, decode_index=0))

    retained = decode.poll(0.0, 0)
    acked = retained[-1].seq if retained else 0
    handoff("h8")
    events, acked = _events_until(decode, "h8", lambda e: isinstance(e, RequestError) or e.finished, acked)
    expected = _tokens(events)

    in_execute, release_step, step_went_on = threading.Event(), threading.Event(), threading.Event()
    held_blocks: list[int] = []
    execute = decode.engine.executor.execute

    def held_execute(output, *args, **kwargs):
        if not release_step.is_set():
            held_blocks.extend(b for item in output.scheduled for b in item.block_ids)
            in_execute.set()
            release_step.wait(EVENT_WAIT_S)
            step_went_on.set()
        return execute(output, *args, **kwargs)

    monkeypatch.setattr(decode.engine.executor, "execute", held_execute)
    handoff("h9")
    assert in_execute.wait(EVENT_WAIT_S)  # h9's first decode step is held inside its forward
    held_since_s = time.monotonic()
    late: list = []
    try:
        # a long lease: its bound (half of call_timeout_s) is far away, however slow this machine
        during = decode.reserve(ReserveRequest("h10", PROMPT, GREEDY, _meta(prefill, "h10", lease_s=60.0), 1))
        assert during.reserved and during.bound_meta.secret
        assert not step_went_on.is_set()  # served inside the step, not after it
        scheduler = decode.engine.scheduler
        h10_blocks = scheduler.block_manager.block_ids(scheduler.reserved["h10"])
        assert held_blocks and not set(h10_blocks) & set(held_blocks)
        aborted = threading.Thread(target=decode.abort, args=("h10",))
        aborted.start()
        aborted.join(0.2)  # waits for the step (it takes the engine lock)
        assert aborted.is_alive()
        # a short lease: once the held step is older than half its reserve timeout, a reserve waits for it
        bound_s = call_timeout_s(0.5) / 2
        time.sleep(max(0.0, bound_s - (time.monotonic() - held_since_s)) + 0.05)
        waiting = threading.Thread(
            target=lambda: late.append(
                decode.reserve(ReserveRequest("h11", PROMPT, GREEDY, _meta(prefill, "h11", lease_s=0.5), 1))
            )
        )
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive() and not late
    finally:
        release_step.set()
    for thread in (aborted, waiting):
        thread.join(EVENT_WAIT_S)
        assert not thread.is_alive()
    assert late and late[0].reserved  # after the step; its handoff never comes: its lease frees it
    h9: list = []
    h11: list = []
    deadline_s = time.monotonic() + EVENT_WAIT_S
    while not (h9 and (isinstance(h9[-1], RequestError) or h9[-1].finished) and h11):
        assert time.monotonic() < deadline_s, (h9, h11)
        for polled in decode.poll(0.05, acked):
            acked = polled.seq
            {"h9": h9, "h11": h11}.get(polled.event.handoff_id, []).append(polled.event)
    assert _tokens(h9) == expected
    assert len(h11) == 1 and isinstance(h11[0], RequestError)
    decode.engine.scheduler.block_manager.check_invariants()
    _assert_idle(prefill, decode)


def test_shm_grpc_pairs_take_shm_on_the_node_and_grpc_across() -> None:
    """`shm+grpc` (`auto` on several nodes): each decode rank listens on shm and gRPC over one set of
    reservations and advertises its node; the prefill rank sends by shm to the decode on its node and by
    gRPC to the other (here the same host, its address labelled with another node's id, as a decode rank on
    another Ray node reports it). Both handoffs complete with the same greedy tokens; only the same-node
    decode's was written in place into its shared KV cache. A same-node address whose socket cannot be
    reached falls back to gRPC. Nothing is held afterwards."""
    from pdcluster.kvtransfer.paired import PairedAddress, node_id
    from pdcluster.workers.prefill import PrefillWorker

    topo = _topology(k=1)
    decodes = [DecodeWorker(topo.engine_config("decode"), f"decode-{i}") for i in range(2)]
    prefill = PrefillWorker(topo.engine_config("prefill"), "prefill-0", layerwise=True)
    try:
        here, there = (d.start_receiver("shm+grpc") for d in decodes)
        assert isinstance(here, PairedAddress) and here.node_id == node_id()
        elsewhere = PairedAddress("another-node", there.shm, there.grpc)
        prefill.connect_receivers("shm+grpc", [[here], [elsewhere]])
        assert prefill.sender_transports() == [["shm"], ["grpc"]]
        tokens = []
        for index, decode in enumerate(decodes):
            handoff_id = f"pair-{index}"
            reserved = decode.reserve(
                ReserveRequest(handoff_id, PROMPT, GREEDY, _meta(prefill, handoff_id), 1)
            )
            assert reserved.reserved
            _prefill(
                prefill, PrefillRequest(handoff_id, PROMPT, GREEDY, reserved.bound_meta, decode_index=index)
            )
            events, _ = _events_until(decode, handoff_id, lambda e: isinstance(e, RequestError) or e.finished)
            assert all(isinstance(e, TokenDelta) for e in events), events
            assert events[0].new_token_ids == ()  # the first token is prefill's reply's
            tokens.append(_tokens(events))
        assert tokens[0] == tokens[1] and len(tokens[0]) == GREEDY.max_tokens - 1
        # shm writes in place (decode's cache is shared): no segment; gRPC takes neither
        in_place = [d.kv_in_place_stats() for d in decodes]
        assert in_place == [{"granted": 1, "fenced": 0}, {"granted": 0, "fenced": 0}]
        assert decodes[0].num_kv_segments() == 0 and decodes[1].num_kv_segments() == 0
        # On this node by id, yet its socket out of reach (another temp dir, container or uid): gRPC.
        prefill.set_decode_address(1, PairedAddress(node_id(), "/nonexistent/kv.sock", there.grpc))
        assert prefill.sender_transports() == [["shm"], ["grpc"]]
        reserved = decodes[1].reserve(
            ReserveRequest("pair-far", PROMPT, GREEDY, _meta(prefill, "pair-far"), 1)
        )
        _prefill(prefill, PrefillRequest("pair-far", PROMPT, GREEDY, reserved.bound_meta, decode_index=1))
        events, _ = _events_until(decodes[1], "pair-far", lambda e: isinstance(e, RequestError) or e.finished)
        assert _tokens(events) == tokens[0]
        for decode in decodes:
            _assert_idle(prefill, decode)
    finally:
        prefill.close()
        for decode in decodes:
            decode.close()
