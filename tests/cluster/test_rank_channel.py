"""The one-host rank channel: its records round-trip through the generic codec, and `SocketRankClient` drives
real prefill and decode workers in this process over it (ordered commands, pushed events exactly once and
in order across a reconnect, refused connections)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from pdcluster.driver import rank_wire as wire
from pdcluster.driver.command_order import CommandSeq
from pdcluster.driver.messages import (
    DecodeNodeLoad,
    DraftCounts,
    Phases,
    PolledEvent,
    PrefillBind,
    PrefillFirstToken,
    PrefillNodeLoad,
    PrefillRequest,
    PrefillResult,
    RequestError,
    ReserveRequest,
    ReserveResult,
    TokenDelta,
)
from pdcluster.driver.socket_rank_client import SocketRankClient
from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kvtransfer.base import HandoffMeta, ProtocolError
from tests.cluster.test_nodes_in_process import EVENT_WAIT_S, GREEDY, PROMPT, _assert_idle, _meta

META = HandoffMeta("h", 3, 4, 8, lease_s=5.0, secret=b"\x00secret")
PARAMS = SamplingParams(temperature=0.5, top_k=3, stop=("x",), logit_bias=((1, -2.0),), max_tokens=4)
LOGPROBS = TokenLogprobs(5, -0.25, 1, [5, 6], [-0.25, -1.5])
LOAD = DecodeNodeLoad(
    name="decode-0",
    pid=1,
    engine_thread_alive=True,
    num_engine_errors=0,
    last_engine_error=None,
    ep={"num_experts": 4},
    num_free_blocks=3,
    num_total_blocks=8,
    num_running=1,
    num_reserved=0,
    num_waiting_for_seat=0,
    taken_s=2.5,
)


def _round_trip_to_rank(record):
    return wire.decode_to_rank(wire.frame(record)[wire.LENGTH.size :])


def test_records_to_a_rank_round_trip_with_their_typed_messages() -> None:
    order = CommandSeq("s", 3)
    records = [
        wire.Hello("k"),
        wire.Reserve(1, ReserveRequest("h", (1, 2), PARAMS, META, 1)),
        wire.Prefill(2, PrefillRequest("h", (1, 2), PARAMS, META, 1, 0, True, None), order),
        wire.Bind(PrefillBind("h", META, 1, 0), None),
        wire.Abort("h", order),
        wire.Load(3),
        wire.Subscribe(7),
        wire.Ack(9),
    ]
    for record in records:
        assert _round_trip_to_rank(record) == record
    assert _round_trip_to_rank(records[1]).request.meta.secret == META.secret  # (secret: compare=False)


def test_records_to_the_driver_round_trip_and_replies_decode_as_their_call_asks() -> None:
    delta = TokenDelta(
        "h", (4, 5), True, "stop", Phases(admit_s=0.5), 64, DraftCounts(2, 1, (2,), (1,)), "ab", (LOGPROBS,)
    )
    pushed = wire.pushed([PolledEvent(1, delta), PolledEvent(2, RequestError("g", "lost"))], LOAD)
    back = wire.decode_to_driver(wire.frame(pushed)[wire.LENGTH.size :])
    assert wire.polled(back) == [PolledEvent(1, delta), PolledEvent(2, RequestError("g", "lost"))]
    assert back.load == LOAD
    result = PrefillResult(5, 1, 0.5, 0.25, prompt_logprobs=(None, LOGPROBS))
    for value in (result, PrefillFirstToken(5, "a"), ReserveResult(META, LOAD), ReserveResult(None)):
        reply = wire.decode_to_driver(wire.frame(wire.reply(4, value))[wire.LENGTH.size :])
        assert wire.decode_as(reply.value, type(value)) == value
    with pytest.raises(ProtocolError, match="no PrefillNodeLoad"):
        wire.decode_as(wire.reply(1, LOAD).value, PrefillNodeLoad)


def test_malformed_records_and_oversized_frames_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode_to_rank(b"\x93\x01\x02\x03")
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode_to_driver(wire.frame(wire.Load(1))[wire.LENGTH.size :])  # a rank's record, not ours
    with pytest.raises(ProtocolError, match="a frame of"):
        wire.frame_length(wire.LENGTH.pack(wire.MAX_FRAME_BYTES + 1))


def test_a_rank_methods_exception_is_rebuilt_as_its_own_class_where_it_can_be() -> None:
    rebuilt = wire.remote_error(wire.failed(1, ValueError("no room ever")))
    assert type(rebuilt) is ValueError and str(rebuilt) == "no room ever"
    from pdcluster.driver.command_order import StaleCommand

    assert type(wire.remote_error(wire.failed(1, StaleCommand("late")))) is StaleCommand
    foreign = wire.remote_error(wire.Failed(1, "some.module.Odd", "why"))
    assert type(foreign) is RuntimeError and str(foreign) == "Odd: why"


# ---- real workers over the channel -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nodes():
    from tests.cluster.test_cluster import _topology
    from tests.faults import FaultyDecodeWorker, FaultyPrefillWorker

    topo = _topology(k=1)
    decode = FaultyDecodeWorker(topo.engine_config("decode"), "decode-0")
    prefill = FaultyPrefillWorker(topo.engine_config("prefill"), "prefill-0", layerwise=True)
    prefill.connect_receivers("shm", [[decode.start_receiver("shm")]])
    yield prefill, decode
    prefill.close()
    decode.close()


def _clients(prefill, decode) -> tuple[SocketRankClient, SocketRankClient]:
    return (
        SocketRankClient(None, "prefill", "prefill-0", prefill.serve_driver_channel()),
        SocketRankClient(None, "decode", "decode-0", decode.serve_driver_channel()),
    )


async def _events_until_finished(client: SocketRankClient, handoff_id: str, lose_link_after: int = -1):
    """`client.events` until `handoff_id` finishes; after `lose_link_after` of its events, the link is closed
    once (the next call raises RankConnectionLost, the one after reconnects)."""
    events, deadline_s, lost = [], time.monotonic() + EVENT_WAIT_S, 0
    while time.monotonic() < deadline_s:
        try:
            batch, load = await client.events(0.05, EVENT_WAIT_S)
        except wire.RankConnectionLost:
            lost += 1
            continue
        assert isinstance(load, DecodeNodeLoad)
        events += [e for e in batch if e.handoff_id == handoff_id]
        if len(events) > lose_link_after >= 0 and not lost:
            client.close()
            lose_link_after = -1
        if events and (isinstance(events[-1], RequestError) or events[-1].finished):
            return events, lost
    raise AssertionError(f"{handoff_id} did not finish in {EVENT_WAIT_S} s: {events}")


def test_a_handoff_over_the_channel_streams_each_event_once_across_a_reconnect(nodes) -> None:
    prefill, decode = nodes
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def run():
        p, d = _clients(prefill, decode)
        reserved = await d.reserve(
            ReserveRequest("c1", PROMPT, params, _meta(prefill, "c1"), 1), EVENT_WAIT_S
        )
        assert reserved.reserved and isinstance(reserved.load, DecodeNodeLoad)
        call = p.prefill(PrefillRequest("c1", PROMPT, params, reserved.bound_meta, 0), EVENT_WAIT_S)
        first, result = await call.first, await call.result
        assert first.first_token_id == result.first_token_id and result.num_drafts == 1
        events, lost = await _events_until_finished(d, "c1", lose_link_after=2)
        assert isinstance(await p.load(EVENT_WAIT_S), PrefillNodeLoad)
        return events, lost

    events, lost = asyncio.run(run())
    assert lost == 1
    assert all(isinstance(e, TokenDelta) for e in events), events
    assert sum(len(e.new_token_ids) for e in events) == params.max_tokens - 1  # none lost, none twice
    assert events[-1].finish_reason == "length"
    _assert_idle(prefill, decode)


def test_an_abort_sent_right_after_its_prefill_never_overtakes_it(nodes) -> None:
    """A prefill awaiting its bind, then its abort: the abort comes second, so the prefill fails at once
    (an abort taken first would find nothing, and the prefill would wait for its bind)."""
    prefill, decode = nodes

    async def run():
        p, _ = _clients(prefill, decode)
        call = p.prefill(
            PrefillRequest("o1", PROMPT, GREEDY, _meta(prefill, "o1"), 0, awaiting_bind=True), 30
        )
        p.abort("o1")
        with pytest.raises(RuntimeError, match="aborted by the router"):
            await asyncio.wait_for(call.result, EVENT_WAIT_S)
        assert call.first.done()

    asyncio.run(run())
    _assert_idle(prefill, decode)


def test_a_reserve_the_rank_refuses_raises_its_error_and_an_unknown_bind_changes_nothing(nodes) -> None:
    prefill, decode = nodes
    huge = tuple(range(10, 10 + 100_000))

    async def run():
        p, d = _clients(prefill, decode)
        with pytest.raises(ValueError):
            await d.reserve(ReserveRequest("r1", huge, GREEDY, _meta(prefill, "r1"), 1), EVENT_WAIT_S)
        p.bind(PrefillBind("nobody", _meta(prefill, "nobody"), 0))
        return await p.load(EVENT_WAIT_S)

    assert asyncio.run(run()).num_requests == 0
    _assert_idle(prefill, decode)


def test_connections_without_the_secret_are_refused(nodes) -> None:
    _, decode = nodes
    address = decode.serve_driver_channel()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(EVENT_WAIT_S)
        sock.connect(address.path)
        sock.sendall(wire.frame(wire.Hello("not the secret")))
        assert sock.recv(1) == b""  # closed without a welcome
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(EVENT_WAIT_S)
        sock.connect(address.path)
        sock.sendall(wire.frame(wire.Load(1)))  # a call before the hello
        assert sock.recv(1) == b""

    async def run():
        wrong = SocketRankClient(None, "decode", "decode-0", wire.ChannelAddress(address.path, "wrong"))
        with pytest.raises(wire.RankConnectionLost):
            await wrong.load(EVENT_WAIT_S)
        return await SocketRankClient(None, "decode", "decode-0", address).load(EVENT_WAIT_S)

    assert isinstance(asyncio.run(run()), DecodeNodeLoad)


def test_the_transport_is_chosen_once_per_deployment_from_its_topology(monkeypatch) -> None:
    from pathlib import Path

    from pdcluster.config import load_topology
    from pdcluster.driver.instance import Instance
    from pdcluster.driver.rank_client import RayRankClient
    from pdcluster.driver.wiring import RANK_TRANSPORT_ENV, rank_transport

    clusters = Path(__file__).resolve().parents[2] / "clusters"
    local, two_nodes = load_topology(clusters / "local.yaml"), load_topology(clusters / "gpu-2node.yaml")
    monkeypatch.delenv(RANK_TRANSPORT_ENV, raising=False)
    assert (rank_transport(local), rank_transport(two_nodes)) == ("socket", "ray")
    monkeypatch.setenv(RANK_TRANSPORT_ENV, "ray")
    assert rank_transport(local) == "ray"
    monkeypatch.setenv(RANK_TRANSPORT_ENV, "socket")
    with pytest.raises(ValueError, match="driver's host"):
        rank_transport(two_nodes)
    monkeypatch.setenv(RANK_TRANSPORT_ENV, "grpc")
    with pytest.raises(ValueError, match="one of auto, ray, socket"):
        rank_transport(local)
    actor = object()
    assert isinstance(Instance("decode", 0, [actor], transport="socket").client(0), SocketRankClient)
    assert isinstance(Instance("prefill", 0, [actor]).client(0), RayRankClient)
