"""gRPC transport on loopback: a real `KVReceiverServer` and `GrpcKVSender` in this process.

Faults are injected only through the sender's `fault_hook`; everything else is the real transport.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest
import torch

from kernels.kv_quant import quantize_kv_int8
from kvtransfer.base import (
    ChecksumMismatch,
    HandoffRefused,
    ProtocolError,
    SenderLost,
    TransferAborted,
    TransferTimeout,
    new_handoff_secret,
)
from kvtransfer.grpc_transport import (
    HANDOFF_ID_KEY,
    HANDOFF_SECRET_KEY,
    GrpcKVSender,
    KVReceiverServer,
    TLSCredentials,
    extras_to_proto,
    header_to_proto,
    meta_to_proto,
)
from kvtransfer.reservations import State
from kvtransfer.wire import encode_layer
from protos import kv_transfer_pb2 as pb
from protos import kv_transfer_pb2_grpc as pb_grpc
from tests.kvtransfer.conftest import (
    GatedCallback,
    assert_extras_equal,
    bits_equal,
    flip_byte_in_layer,
    make_extras,
    make_handoff,
    make_layers,
    stall_after,
    write_test_certificates,
)

WAIT_S = 10.0  # generous upper bound for waits that should end much sooner; never a measured threshold


@pytest.fixture
def server():
    server = KVReceiverServer("127.0.0.1", 0)
    yield server
    server.close(grace_s=0)


def make_sender(server: KVReceiverServer, **kwargs) -> GrpcKVSender:
    return GrpcKVSender(server.address, **kwargs)


def send_all(sender, meta, layers, extras, order=None) -> None:
    sender.begin(meta)
    for layer_idx in order or range(meta.num_layers):
        sender.send_layer(meta.request_id, layer_idx, layers[layer_idx])
    sender.finish(meta.request_id, extras)


def assert_no_leaks(sender, server) -> None:
    assert sender.pending_request_ids() == []
    assert server.pending_request_ids() == []


def test_five_layer_handoff_arrives_bit_exact_with_extras(server):
    meta = make_handoff("bitexact", num_tokens=300)  # 300 * 24 * 2 = 14,400 B per layer: 15 chunks of 1,000 B
    layers, extras = make_layers(meta), make_extras(meta, with_probs=True)
    sender = make_sender(server, max_chunk_bytes=1000)
    meta = server.expect(meta)
    send_all(sender, meta, layers, extras, order=[4, 0, 3, 1, 2])  # any order; MTP layer first here
    received = server.wait(meta.request_id, WAIT_S)
    assert [bits_equal(r.latent, x) and r.scale is None for r, x in zip(received.layers, layers, strict=True)]
    assert all(bits_equal(r.latent, x) for r, x in zip(received.layers, layers, strict=True))
    assert_extras_equal(received.extras, extras)
    assert (
        received.num_wire_bytes == meta.num_layers * meta.num_tokens * meta.kv_dim * torch.bfloat16.itemsize
    )
    assert sender.flush(WAIT_S) == {}
    server.release(meta.request_id)
    assert_no_leaks(sender, server)
    sender.close()


def test_two_handoffs_in_flight_at_once(server):
    metas = [make_handoff(f"concurrent-{i}", num_tokens=50 + i) for i in range(2)]
    sender = make_sender(server)
    for meta in metas:
        meta = server.expect(meta)
        sender.begin(meta)
    layers = [make_layers(meta, seed=i) for i, meta in enumerate(metas)]
    for layer_idx in range(5):  # interleaved, as two requests in one prefill batch
        for meta, lay in zip(metas, layers, strict=True):
            sender.send_layer(meta.request_id, layer_idx, lay[layer_idx])
    for i, meta in enumerate(metas):
        sender.finish(meta.request_id, make_extras(meta, seed=i))
    for meta, lay in zip(metas, layers, strict=True):
        received = server.wait(meta.request_id, WAIT_S)
        assert all(bits_equal(r.latent, x) for r, x in zip(received.layers, lay, strict=True))
        server.release(meta.request_id)
    assert sender.flush(WAIT_S) == {}
    assert_no_leaks(sender, server)
    sender.close()


def test_send_layer_returns_while_the_receiver_is_still_blocked(server):
    """Layer-wise streaming overlaps: every send_layer and finish return while decode is stuck in its first
    on_layer callback (held by an event), i.e. before the bytes are delivered."""
    meta = make_handoff("overlap")
    layers, extras = make_layers(meta), make_extras(meta)
    slow_decode = GatedCallback()
    meta = server.expect(meta, on_layer=slow_decode)
    sender = make_sender(server)
    send_all(sender, meta, layers, extras)  # must not block on the receiver
    assert slow_decode.entered.wait(WAIT_S)  # the first layer reached decode, which is now blocked
    assert slow_decode.layers == {}  # nothing delivered yet, yet every send_layer has returned
    with pytest.raises(TransferTimeout, match="wait timed out"):
        server.wait(meta.request_id, 0.01)  # incomplete; the reservation stays
    slow_decode.gate.set()
    received = server.wait(meta.request_id, WAIT_S)
    assert received.layers == []  # the callback consumed them
    assert all(bits_equal(slow_decode.layers[i].latent, layers[i]) for i in range(meta.num_layers))
    assert_extras_equal(received.extras, extras)
    server.release(meta.request_id)
    assert sender.flush(WAIT_S) == {}
    assert_no_leaks(sender, server)
    sender.close()


def test_corrupted_byte_is_a_checksum_mismatch_naming_the_layer(server):
    meta = make_handoff("corrupt", num_tokens=200)
    sender = make_sender(server, max_chunk_bytes=1000, fault_hook=flip_byte_in_layer(3, byte_offset=4321))
    meta = server.expect(meta)
    send_all(sender, meta, make_layers(meta), make_extras(meta))
    with pytest.raises(ChecksumMismatch, match="layer 3"):
        server.wait(meta.request_id, WAIT_S)
    server.release(meta.request_id)
    failures = sender.flush(WAIT_S)
    assert list(failures) == [meta.request_id] and isinstance(failures[meta.request_id], ChecksumMismatch)
    assert "layer 3" in str(failures[meta.request_id])
    assert_no_leaks(sender, server)
    sender.close()


def test_sender_that_stalls_after_two_layers_times_out_within_the_lease(server):
    meta = make_handoff("stall", lease_s=0.5)
    sender = make_sender(server, fault_hook=stall_after(2))
    meta = server.expect(meta)
    send_all(sender, meta, make_layers(meta), make_extras(meta))
    started_s = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"lease of 0.5 s expired with 2/5 layers arrived"):
        server.wait(meta.request_id, WAIT_S)
    assert time.monotonic() - started_s < WAIT_S  # the lease fired, not the wait's timeout
    server.release(meta.request_id)
    failures = sender.flush(WAIT_S)  # the sender's own lease ends its call too
    assert list(failures) == [meta.request_id]
    assert_no_leaks(sender, server)
    sender.close()


def test_explicit_abort(server):
    meta = make_handoff("abort")
    layers = make_layers(meta)
    sender = make_sender(server)
    meta = server.expect(meta)
    sender.begin(meta)
    sender.send_layer(meta.request_id, 0, layers[0])
    sender.send_layer(meta.request_id, 1, layers[1])
    sender.abort(meta.request_id, "prefill instance draining")
    with pytest.raises(TransferAborted, match="prefill instance draining"):
        server.wait(meta.request_id, WAIT_S)
    server.release(meta.request_id)
    assert sender.flush(WAIT_S) == {}  # the abort itself was delivered
    with pytest.raises(ValueError, match="no open handoff"):
        sender.send_layer(meta.request_id, 2, layers[2])
    assert_no_leaks(sender, server)
    sender.close()


def test_sender_closing_mid_handoff_is_seen_at_once(server):
    meta = make_handoff("lost", lease_s=60.0)
    layers = make_layers(meta)
    sender = make_sender(server)
    decode = GatedCallback()
    decode.gate.set()
    meta = server.expect(meta, on_layer=decode)
    sender.begin(meta)
    sender.send_layer(meta.request_id, 0, layers[0])
    assert decode.entered.wait(WAIT_S)  # layer 0 is on decode: the stream is established
    sender.close()  # e.g. the prefill actor is shutting down
    with pytest.raises(SenderLost, match="sender lost with 1/5 layers arrived"):
        server.wait(meta.request_id, WAIT_S)  # long before the 60 s lease
    server.release(meta.request_id)
    assert_no_leaks(sender, server)


def test_int8_wire_halves_the_bytes_within_tolerance(server):
    meta = make_handoff("int8", dtype="float32", wire_dtype="int8")
    layers, extras = make_layers(meta), make_extras(meta)
    sender = make_sender(server)
    meta = server.expect(meta)
    send_all(sender, meta, layers, extras)
    received = server.wait(meta.request_id, WAIT_S)
    for got, want in zip(received.layers, layers, strict=True):
        assert got.latent.dtype == torch.float32 and got.scale is None
        # quantize_kv_int8's bound: |x - x_hat| <= scale / 2 per element, scale = absmax(row) / 127
        bound = want.abs().amax(dim=-1, keepdim=True) / 127 / 2
        assert bool(((got.latent - want).abs() <= bound * (1 + 1e-6)).all())
    # 37 tokens x 24 values: float32 3,552 B per layer; int8 888 B values + 148 B scales = 1,036 B
    assert meta.layer_wire_bytes == 37 * 24 * torch.int8.itemsize + 37 * torch.float32.itemsize == 1036
    assert received.num_wire_bytes == 5 * 1036
    bf16_meta = make_handoff("x", dtype="bfloat16", wire_dtype="int8", num_tokens=1, kv_dim=576)
    assert bf16_meta.layer_wire_bytes == 580  # DeepSeek-V3 per token per layer: 580 B vs 1,152 B in bf16
    server.release(meta.request_id)
    assert sender.flush(WAIT_S) == {}
    assert_no_leaks(sender, server)
    sender.close()


def test_int8_passthrough_hands_int8_and_scales_to_an_int8_cache():
    server = KVReceiverServer("127.0.0.1", 0, int8_passthrough=True)
    meta = make_handoff("int8-pass", wire_dtype="int8")
    layers = make_layers(meta)
    sender = make_sender(server)
    meta = server.expect(meta)
    send_all(sender, meta, layers, make_extras(meta))
    received = server.wait(meta.request_id, WAIT_S)
    for got, want in zip(received.layers, layers, strict=True):
        want_int8, want_scale = quantize_kv_int8(want)
        assert bits_equal(got.latent, want_int8) and bits_equal(got.scale, want_scale)
    server.release(meta.request_id)
    sender.flush(WAIT_S)
    assert_no_leaks(sender, server)
    sender.close()
    server.close(grace_s=0)


def test_data_without_a_reservation_is_refused(server):
    meta = make_handoff("unexpected", secret=new_handoff_secret())
    sender = make_sender(server)
    send_all(sender, meta, make_layers(meta), make_extras(meta))
    failures = sender.flush(WAIT_S)
    assert isinstance(failures[meta.request_id], ProtocolError)
    assert "no reservation" in str(failures[meta.request_id])
    assert_no_leaks(sender, server)
    sender.close()


def test_handoff_that_disagrees_with_the_reservation_is_refused(server):
    meta = make_handoff("mismatch")
    meta = server.expect(meta)
    wrong = make_handoff("mismatch", num_tokens=meta.num_tokens + 1, secret=meta.secret)
    sender = make_sender(server)
    send_all(sender, wrong, make_layers(wrong), make_extras(wrong))
    with pytest.raises(ProtocolError, match="num_tokens=38"):
        server.wait(meta.request_id, WAIT_S)
    server.release(meta.request_id)
    assert isinstance(sender.flush(WAIT_S)[meta.request_id], ProtocolError)
    assert_no_leaks(sender, server)
    sender.close()


def test_release_waits_for_a_running_callback_and_later_layers_are_refused(server):
    meta = make_handoff("release-midway")
    slow_decode = GatedCallback()
    meta = server.expect(meta, on_layer=slow_decode)
    sender = make_sender(server)
    send_all(sender, meta, make_layers(meta), make_extras(meta))
    assert slow_decode.entered.wait(WAIT_S)
    released = threading.Event()
    releaser = threading.Thread(target=lambda: (server.release(meta.request_id), released.set()))
    releaser.start()
    assert not released.wait(0.05)  # release() blocks while the callback runs ...
    slow_decode.gate.set()
    releaser.join(WAIT_S)
    assert released.is_set() and len(slow_decode.layers) == 1  # ... and no callback runs after it
    assert isinstance(sender.flush(WAIT_S)[meta.request_id], ProtocolError)
    assert_no_leaks(sender, server)
    sender.close()


def _wait_until(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.01)
    return True


def test_refused_handoff_is_forgotten_without_flush(server):
    """A failed call (its queued layers included) is dropped as soon as it ends; only its error waits
    for flush. Before the fix it stayed in the sender until someone called flush (a leak per refusal)."""
    metas = [make_handoff(f"refused-{i}", secret=new_handoff_secret()) for i in range(3)]
    sender = make_sender(server)
    for meta in metas:  # no reservation on decode: each call is refused
        send_all(sender, meta, make_layers(meta), make_extras(meta))
    assert _wait_until(lambda: sender.pending_request_ids() == []), sender.pending_request_ids()
    failures = sender.flush(WAIT_S)  # the errors are still reported, once
    assert sorted(failures) == sorted(m.request_id for m in metas)
    assert all(isinstance(e, ProtocolError) for e in failures.values())
    assert sender.flush(WAIT_S) == {}
    sender.close()


def test_call_that_failed_before_finish_drops_later_layers_and_is_forgotten_on_finish(server):
    meta = make_handoff("refused-early", secret=new_handoff_secret())
    layers = make_layers(meta)
    sender = make_sender(server)
    sender.begin(meta)
    sender.send_layer(meta.request_id, 0, layers[0])
    # refused (no reservation): the call ends while the handoff is still open on this side
    assert _wait_until(lambda: sender._calls[meta.request_id].done)
    assert sender.pending_request_ids() == [meta.request_id]  # open: prefill still owns it
    for layer_idx in range(1, meta.num_layers):
        sender.send_layer(meta.request_id, layer_idx, layers[layer_idx])  # silently dropped
    assert sender._calls[meta.request_id].messages.qsize() <= 1  # at most the wake-up, no tensors
    sender.finish(meta.request_id, make_extras(meta))
    assert sender.pending_request_ids() == []  # forgotten at once, no flush
    assert isinstance(sender.flush(WAIT_S)[meta.request_id], ProtocolError)
    sender.close()


def test_failure_log_is_bounded():
    from kvtransfer.base import FailureLog, KVTransferError

    log = FailureLog(max_records=3)
    for i in range(5):
        log.add(f"r{i}", KVTransferError(f"e{i}"))
    assert len(log) == 3
    assert sorted(log.pop_all()) == ["r2", "r3", "r4"]
    assert len(log) == 0


# ---- authentication and limits (issue 12, finding 9) ----


class IdleRequests:
    """A request iterator that yields nothing until `release()`: an idle client stream (its messages, if
    any, come only after the release)."""

    def __init__(self, messages=()) -> None:
        self._released = threading.Event()
        self._messages = list(messages)

    def release(self) -> None:
        self._released.set()

    def __iter__(self):
        return self

    def __next__(self):
        self._released.wait()
        if not self._messages:
            raise StopIteration
        return self._messages.pop(0)


def raw_call(server, requests, metadata=None, timeout_s=None):
    """A `Transfer` call made with the bare generated stub (what a process that is not our sender can do)."""
    channel = grpc.insecure_channel(server.address)
    future = pb_grpc.KVTransferStub(channel).Transfer.future(requests, metadata=metadata, timeout=timeout_s)
    future.add_done_callback(lambda _: channel.close())
    return future


def forged_messages(meta):
    """Begin + one layer of junk + Finish carrying a forged first token, as protobuf messages."""
    junk = make_layers(meta, seed=99)[0]
    layer = encode_layer(meta, 0, junk)
    extras = make_extras(meta)
    extras.first_token_id = 666
    chunk = pb.LayerChunk(layer_idx=0, offset_bytes=0, data=layer.payload.numpy().tobytes())
    chunk.header.CopyFrom(header_to_proto(layer.header))
    return [
        pb.KVMessage(begin=meta_to_proto(meta)),
        pb.KVMessage(chunk=chunk),
        pb.KVMessage(finish=extras_to_proto(extras)),
    ]


def rpc_code(future) -> grpc.StatusCode:
    exc = future.exception(timeout=WAIT_S)
    assert exc is not None, "the call succeeded"
    return exc.code()


def assert_still_waiting(server, request_id: str) -> None:
    """The reservation is alive and incomplete: a short wait times out without failing it."""
    with pytest.raises(TransferTimeout, match="wait timed out"):
        server.wait(request_id, 0.01)


def assert_delivers_bit_exact(server, sender, meta, seed: int = 0) -> None:
    layers, extras = make_layers(meta, seed=seed), make_extras(meta, seed=seed)
    send_all(sender, meta, layers, extras)
    received = server.wait(meta.request_id, WAIT_S)
    assert all(bits_equal(r.latent, x) for r, x in zip(received.layers, layers, strict=True))
    assert_extras_equal(received.extras, extras)
    server.release(meta.request_id)
    assert sender.flush(WAIT_S) == {}


def test_forged_handoff_for_a_live_id_is_refused_and_the_victim_completes(server):
    """The attack of finding 9 with our own sender: the right request id, a wrong secret, a forged first
    token. Refused before any of its data is read; the victim's reservation keeps waiting for the real
    sender, whose handoff then arrives bit-exact (first token 7, not the forged 666)."""
    meta = server.expect(make_handoff("victim"))
    forger = make_sender(server)
    forged = dataclasses.replace(meta, secret=new_handoff_secret())
    extras = make_extras(forged)
    extras.first_token_id = 666
    send_all(forger, forged, make_layers(forged, seed=99), extras)
    failures = forger.flush(WAIT_S)
    assert list(failures) == ["victim"] and isinstance(failures["victim"], HandoffRefused)
    assert "wrong handoff secret" in str(failures["victim"])
    assert meta.secret.hex() not in str(failures["victim"]) and forged.secret.hex() not in str(
        failures["victim"]
    )
    assert_still_waiting(server, "victim")
    sender = make_sender(server)
    assert_delivers_bit_exact(server, sender, meta)
    assert server.num_refused_streams == 1
    assert_no_leaks(sender, server)
    forger.close()
    sender.close()


def test_missing_secret_is_refused_before_any_message_is_read(server):
    meta = server.expect(make_handoff("no-secret"))
    unbound = make_handoff("no-secret")  # what the router built, before decode's expect bound it
    with pytest.raises(ValueError, match="no secret"):
        make_sender(server).begin(unbound)
    # Bare stubs: no credentials, an id alone, an empty secret. Each stream stays idle (sends nothing
    # until released), so a refusal proves nothing was read; released, each would send a forged handoff.
    credentials = [
        None,
        [(HANDOFF_ID_KEY, "no-secret")],
        [(HANDOFF_ID_KEY, "no-secret"), (HANDOFF_SECRET_KEY, b"")],
    ]
    streams = [IdleRequests(forged_messages(meta)) for _ in credentials]
    calls = [raw_call(server, s, metadata=m) for s, m in zip(streams, credentials, strict=True)]
    assert [rpc_code(c) for c in calls] == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert "no handoff credentials" in calls[0].exception().details()
    for s in streams:
        s.release()
    assert_still_waiting(server, "no-secret")
    sender = make_sender(server)
    assert_delivers_bit_exact(server, sender, meta)
    assert_no_leaks(sender, server)
    sender.close()


def test_replayed_begin_is_refused_and_the_transfer_in_progress_is_unaffected(server):
    meta = server.expect(make_handoff("replayed"), on_layer=(decode := GatedCallback()))
    decode.gate.set()
    layers, extras = make_layers(meta), make_extras(meta)
    sender = make_sender(server)
    sender.begin(meta)
    sender.send_layer(meta.request_id, 0, layers[0])
    assert decode.entered.wait(WAIT_S)  # the real begin was admitted and layer 0 is on decode
    for secret in (meta.secret, new_handoff_secret()):  # a replay of the real credentials, and a forgery
        replayer = make_sender(server)
        replay = dataclasses.replace(meta, secret=secret)
        send_all(replayer, replay, make_layers(replay, seed=5), make_extras(replay, seed=5))
        failure = replayer.flush(WAIT_S)["replayed"]
        assert isinstance(failure, HandoffRefused), failure
        replayer.close()
    for layer_idx in range(1, meta.num_layers):
        sender.send_layer(meta.request_id, layer_idx, layers[layer_idx])
    sender.finish(meta.request_id, extras)
    received = server.wait(meta.request_id, WAIT_S)
    assert all(bits_equal(decode.layers[i].latent, layers[i]) for i in range(meta.num_layers))
    assert_extras_equal(received.extras, extras)
    late = raw_call(
        server, iter(forged_messages(meta)), [(HANDOFF_ID_KEY, "replayed"), (HANDOFF_SECRET_KEY, meta.secret)]
    )
    assert rpc_code(late) == grpc.StatusCode.UNAUTHENTICATED  # after completion too
    server.wait(meta.request_id, WAIT_S)  # still complete
    server.release(meta.request_id)
    assert sender.flush(WAIT_S) == {}
    assert server.num_refused_streams == 3
    assert_no_leaks(sender, server)
    sender.close()


def test_idle_stream_flood_is_refused_and_a_real_handoff_completes():
    """Finding 9's flood: idle streams, three times as many as the receiver has worker threads, half of
    them naming the live request with a wrong secret (before the fix they filled every thread and every
    handoff then timed out). Each is refused without waiting for a message, and the real handoff, sent
    while they are all still open on the client side, completes bit-exact."""
    limit = 4
    server = KVReceiverServer("127.0.0.1", 0, max_concurrent_streams=limit)
    meta = server.expect(make_handoff("flooded"))
    forged = [(HANDOFF_ID_KEY, "flooded"), (HANDOFF_SECRET_KEY, new_handoff_secret())]
    streams = [IdleRequests() for _ in range(3 * limit * 2)]
    calls = [raw_call(server, s, metadata=None if i % 2 else forged) for i, s in enumerate(streams)]
    assert {rpc_code(c) for c in calls} == {grpc.StatusCode.UNAUTHENTICATED}  # none is left holding a thread
    assert server.num_refused_streams == len(calls)
    sender = make_sender(server)
    assert_delivers_bit_exact(server, sender, meta)
    for s in streams:
        s.release()
    assert_no_leaks(sender, server)
    sender.close()
    server.close(grace_s=0)


def test_admitted_idle_stream_is_cut_at_its_lease_and_calls_beyond_the_limit_are_refused():
    """One worker thread, no queue. A sender admitted with the right secret that then goes idle, its
    client having set no deadline, holds the thread only until its handoff's lease ends (the server cuts
    it off); meanwhile a further call is refused at once (RESOURCE_EXHAUSTED) and its reservation is left
    waiting; after the cut the thread serves a real handoff again."""
    lease_s = 1.0
    server = KVReceiverServer("127.0.0.1", 0, max_concurrent_streams=1, max_queued_streams=0)
    idle_meta = server.expect(make_handoff("idle", lease_s=lease_s))
    idle = IdleRequests()
    idle_call = raw_call(server, idle, [(HANDOFF_ID_KEY, "idle"), (HANDOFF_SECRET_KEY, idle_meta.secret)])
    reservation = server._reservations._reservations["idle"]
    assert _wait_until(lambda: reservation.state is State.CLAIMED)  # admitted: it holds the only thread
    queued = server.expect(make_handoff("beyond-limit"))
    sender = make_sender(server)
    send_all(sender, queued, make_layers(queued), make_extras(queued))
    failure = sender.flush(WAIT_S)["beyond-limit"]
    assert "RESOURCE_EXHAUSTED" in str(failure)
    assert_still_waiting(server, "beyond-limit")
    server.release("beyond-limit")
    started_s = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"lease of 1 s expired"):
        server.wait("idle", WAIT_S)
    assert rpc_code(idle_call) == grpc.StatusCode.CANCELLED  # cut by the server: the client set no deadline
    assert time.monotonic() - started_s < WAIT_S
    server.release("idle")
    idle.release()
    assert_delivers_bit_exact(server, sender, server.expect(make_handoff("after-the-cut")))
    assert_no_leaks(sender, server)
    sender.close()
    server.close(grace_s=0)


def test_tls_handoff_arrives_bit_exact_and_a_plaintext_sender_is_refused(tmp_path):
    files = write_test_certificates(tmp_path)
    if files is None:
        pytest.skip("the openssl CLI is not installed")
    tls = TLSCredentials.from_files(**files, server_name="pdcluster-kv")
    server = KVReceiverServer("127.0.0.1", 0, tls=tls)
    sender = GrpcKVSender(server.address, tls=tls)
    assert_delivers_bit_exact(server, sender, server.expect(make_handoff("tls")))
    plain = GrpcKVSender(server.address)
    meta = server.expect(make_handoff("plaintext"))
    send_all(plain, meta, make_layers(meta), make_extras(meta))
    assert "UNAVAILABLE" in str(plain.flush(WAIT_S)["plaintext"])  # no TLS handshake, no call
    server.release("plaintext")
    assert "private_key" not in repr(tls) and tls.private_key.decode() not in repr(tls)
    with pytest.raises(ValueError, match="key_file .*missing.pem: cannot read"):
        TLSCredentials.from_files(files["cert_file"], tmp_path / "missing.pem", files["ca_file"])
    assert_no_leaks(sender, server)
    sender.close()
    plain.close()
    server.close(grace_s=0)
