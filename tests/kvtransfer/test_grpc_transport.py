"""gRPC-specific behaviour of the KV transport on loopback (a real `KVReceiverServer` and `GrpcKVSender`):
what the shared contract (`test_transport_contract.py`) does not cover: int8 passthrough on the receiver,
the sender forgetting failed calls, call-metadata authentication against bare stubs, stream limits and
lease cut-offs, TLS. Faults come only from the sender's `fault_hook` and from bare generated stubs.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdcluster.kernels.kv_quant import quantize_kv_int8
from pdcluster.kvtransfer.base import ProtocolError, TransferTimeout, new_handoff_secret
from pdcluster.kvtransfer.grpc_transport import (
    HANDOFF_ID_KEY,
    HANDOFF_SECRET_KEY,
    GrpcKVSender,
    KVReceiverServer,
    TLSCredentials,
)
from pdcluster.kvtransfer.reservations import State
from tests.kvtransfer.conftest import (
    assert_extras_equal,
    bits_equal,
    make_extras,
    make_handoff,
    make_layers,
    write_test_certificates,
)
from tests.kvtransfer.contract import WAIT_S, send_all
from tests.kvtransfer.contract_pairs import forged_messages
from tests.kvtransfer.contract_pairs import raw_call as _raw_call


@pytest.fixture
def server():
    server = KVReceiverServer("127.0.0.1", 0)
    yield server
    server.close(grace_s=0)


def make_sender(server: KVReceiverServer, **kwargs) -> GrpcKVSender:
    return GrpcKVSender(server.address, **kwargs)


def raw_call(server, requests, metadata=None, timeout_s=None):
    return _raw_call(server.address, requests, metadata, timeout_s)


def assert_no_leaks(sender, server) -> None:
    assert sender.pending_request_ids() == []
    assert server.pending_request_ids() == []


def _wait_until(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.01)
    return True


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


def test_int8_passthrough_hands_an_int8_caches_bytes_to_an_int8_cache():
    """A passthrough receiver (decode's int8 cache) gets int8 + scales: quantized by the sender from a
    float layer, or exactly the int8 + scales an int8 cache gave `send_layer`."""
    server = KVReceiverServer("127.0.0.1", 0, int8_passthrough=True)
    sender = make_sender(server)
    for request_id, from_int8_cache in (("int8-pass", False), ("int8-cache-pass", True)):
        meta = server.expect(make_handoff(request_id, wire_dtype="int8"))
        quantized = [quantize_kv_int8(x) for x in make_layers(meta)]
        sender.begin(meta)
        for layer_idx, (latent, (values, scales)) in enumerate(
            zip(make_layers(meta), quantized, strict=True)
        ):
            if from_int8_cache:
                sender.send_layer(request_id, layer_idx, values, scales)
            else:
                sender.send_layer(request_id, layer_idx, latent)
        sender.finish(request_id, make_extras(meta))
        received = server.wait(request_id, WAIT_S)
        for got, (values, scales) in zip(received.layers, quantized, strict=True):
            assert bits_equal(got.latent, values) and bits_equal(got.scale, scales)
        server.release(request_id)
    assert sender.flush(WAIT_S) == {}
    assert_no_leaks(sender, server)
    sender.close()
    server.close(grace_s=0)


def test_replay_after_completion_is_refused(server):
    """The real credentials presented again once the handoff completed: UNAUTHENTICATED, and the
    completed reservation is unchanged."""
    meta = server.expect(make_handoff("replayed-late"))
    sender = make_sender(server)
    send_all(sender, meta)
    server.wait(meta.request_id, WAIT_S)
    credentials = [(HANDOFF_ID_KEY, "replayed-late"), (HANDOFF_SECRET_KEY, meta.secret)]
    late = raw_call(server, iter(forged_messages(meta)), credentials)
    assert rpc_code(late) == grpc.StatusCode.UNAUTHENTICATED
    assert server.wait(meta.request_id, WAIT_S).extras.first_token_id == 7  # still complete, not forged
    server.release(meta.request_id)
    assert sender.flush(WAIT_S) == {}
    assert server.num_refused_streams == 1
    assert_no_leaks(sender, server)
    sender.close()


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
    # The cut call's thread is back once its handler has unwound (a moment after the client saw CANCELLED,
    # longer on a loaded machine): until then a new call is refused like the one beyond the limit.
    deadline_s = time.monotonic() + WAIT_S
    for attempt in range(1000):
        meta = server.expect(make_handoff(f"after-the-cut-{attempt}"))
        layers, extras = make_layers(meta), make_extras(meta)
        send_all(sender, meta, layers, extras)
        failure = sender.flush(WAIT_S).get(meta.request_id)
        if failure is None:
            received = server.wait(meta.request_id, WAIT_S)
            assert all(bits_equal(r.latent, x) for r, x in zip(received.layers, layers, strict=True))
            assert_extras_equal(received.extras, extras)
            server.release(meta.request_id)
            break
        assert "RESOURCE_EXHAUSTED" in str(failure)
        server.release(meta.request_id)
        assert time.monotonic() < deadline_s, "the cut call's thread never served again"
        time.sleep(0.05)
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
