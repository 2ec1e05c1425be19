"""What the shm transport adds to the contract (`test_transport_contract.py`): nothing outlives a killed
process, segments are reused, and only the user's own processes can reach them.

The killed side is a real process (spawned, SIGKILLed mid-transfer); the survivor is this test process,
whose `/proc/self/maps` shows every mapping of a segment (`/memfd:pdcluster-kv`). The segments are
anonymous, so /dev/shm must not gain a pdcluster entry either way."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

from pdcluster.kvtransfer.base import ChecksumMismatch, SenderLost
from pdcluster.kvtransfer.shm_transport import Segment, ShmKVReceiver, ShmKVSender, sweep_stale_socket_dirs
from pdcluster.kvtransfer.shm_transport.segments import MEMFD_NAME
from pdcluster.kvtransfer.wire import COPY_CHUNK_BYTES, meta_from_dict, meta_to_dict
from tests.kvtransfer.conftest import (
    bits_equal,
    flip_byte_in_layer,
    make_extras,
    make_handoff,
    make_layers,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux memfd segments")

WAIT_S = 30.0  # bound on waits that end much sooner; never a measured threshold


def own_segment_mappings() -> int:
    """Mappings of shm-transport segments in this process. A closed segment is unmapped with its last view;
    a view caught in a reference cycle (an exception's traceback) goes at the collector's next run, so it
    runs first (earlier tests in this process leave such cycles)."""
    gc.collect()
    return sum(MEMFD_NAME in line for line in Path("/proc/self/maps").read_text().splitlines())


def pdcluster_shm_entries() -> set[str]:
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if "pdcluster" in p.name} if root.is_dir() else set()


def wait_until(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline_s:
            return False
        time.sleep(0.01)
    return True


def _sender_process(address: str, meta_record: dict, num_layers: int) -> None:
    meta = meta_from_dict(meta_record)
    sender = ShmKVSender(address)
    sender.begin(meta)
    for layer_idx, latent in enumerate(make_layers(meta)[:num_layers]):
        sender.send_layer(meta.request_id, layer_idx, latent)
    time.sleep(3600)  # killed mid-transfer


def _receiver_process(pipe, handoff_record: dict) -> None:
    receiver = ShmKVReceiver()
    bound = receiver.expect(meta_from_dict(handoff_record))
    pipe.send((receiver.address, meta_to_dict(bound)))
    time.sleep(3600)  # killed mid-transfer


def test_prefill_killed_mid_transfer_fails_the_handoff_at_once_and_frees_its_segment():
    before = pdcluster_shm_entries()
    receiver = ShmKVReceiver()
    meta = make_handoff("victim", num_tokens=300, lease_s=60.0)
    arrived: list[int] = []
    two_arrived = threading.Event()

    def on_layer(layer_idx, layer):
        arrived.append(layer_idx)
        if len(arrived) == 2:
            two_arrived.set()

    bound = receiver.expect(meta, on_layer)
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_sender_process, args=(receiver.address, meta_to_dict(bound), 2))
    child.start()
    try:
        assert two_arrived.wait(WAIT_S)
        assert receiver.num_segments == 1 and own_segment_mappings() == 1
        os.kill(child.pid, signal.SIGKILL)
        started_s = time.monotonic()
        with pytest.raises(SenderLost, match="sender lost with 2/5 layers arrived"):
            receiver.wait("victim", WAIT_S)
        assert time.monotonic() - started_s < meta.lease_s  # seen at once, not at the lease
        receiver.release("victim")
        assert wait_until(lambda: receiver.num_segments == 0)
        assert own_segment_mappings() == 0  # the dead sender's pages are gone with the last mapping
        assert pdcluster_shm_entries() == before
    finally:
        child.kill()
        child.join(WAIT_S)
        receiver.close()


def test_decode_killed_mid_transfer_fails_the_handoff_unmaps_and_its_socket_dir_is_swept():
    before = pdcluster_shm_entries()
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    meta = make_handoff("victim", num_tokens=300, lease_s=60.0)
    child = ctx.Process(target=_receiver_process, args=(theirs, meta_to_dict(meta)))
    child.start()
    try:
        assert ours.poll(WAIT_S)
        address, bound_record = ours.recv()
        bound = meta_from_dict(bound_record)
        sender = ShmKVSender(address)
        sender.begin(bound)
        layers = make_layers(bound)
        for layer_idx in range(2):
            sender.send_layer("victim", layer_idx, layers[layer_idx])
        assert wait_until(lambda: own_segment_mappings() == 1)  # granted and mapped
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT_S)
        assert wait_until(lambda: sender.pending_request_ids() == ["victim"] and own_segment_mappings() == 0)
        for layer_idx in range(2, bound.num_layers):  # the caller carries on; layers are dropped
            sender.send_layer("victim", layer_idx, layers[layer_idx])
        sender.finish("victim", make_extras(bound))
        failures = sender.flush(WAIT_S)
        assert isinstance(failures["victim"], SenderLost) and "receiver" in str(failures["victim"])
        assert sender.pending_request_ids() == []
        sender.close()
        socket_dir = str(Path(address).parent)
        assert Path(socket_dir).exists()  # killed before close: left behind ...
        assert socket_dir in sweep_stale_socket_dirs()  # ... until the next receiver sweeps it
        assert not Path(socket_dir).exists()
        assert pdcluster_shm_entries() == before
    finally:
        child.kill()
        child.join(WAIT_S)


def test_segments_are_reused_across_handoffs_and_private_to_the_user():
    receiver = ShmKVReceiver()
    sender = ShmKVSender(receiver.address)
    try:
        assert stat.S_IMODE(os.stat(Path(receiver.address).parent).st_mode) == 0o700
        kept = []
        for i, num_tokens in enumerate((300, 37, 300, 120)):
            meta = make_handoff(f"r{i}", num_tokens=num_tokens)
            bound = receiver.expect(meta)
            layers = make_layers(meta, seed=i)
            sender.begin(bound)
            for layer_idx, latent in enumerate(layers):
                sender.send_layer(meta.request_id, layer_idx, latent)
            sender.finish(meta.request_id, make_extras(meta))
            received = receiver.wait(meta.request_id, WAIT_S)
            receiver.release(meta.request_id)
            kept.append((received.layers, layers))
        # kept layers are copies: the handoffs that reused the segment after them did not change them
        for got, sent in kept:
            assert all(bits_equal(r.latent, x) for r, x in zip(got, sent, strict=True))
        assert sender.flush(WAIT_S) == {}
        assert receiver.num_segments == 1  # one handoff at a time: one segment, reused
        segment = Segment(0, 1 << 20)
        assert stat.S_IMODE(os.fstat(segment.fd).st_mode) == 0o600
        segment.close()
    finally:
        sender.close()
        receiver.close()
    assert not Path(receiver.address).parent.exists()


def test_segments_beyond_the_pools_free_bytes_are_closed_on_both_sides():
    """Two handoffs in flight need two segments; with room for none free, each is closed when its sender
    is done with it, and the sender unmaps it too (decode's `drop`)."""
    receiver = ShmKVReceiver(max_free_bytes=0)
    sender = ShmKVSender(receiver.address)
    try:
        metas = [make_handoff(f"d{i}", num_tokens=300) for i in range(2)]
        bound = [receiver.expect(meta) for meta in metas]
        for meta in bound:
            sender.begin(meta)
        for meta in bound:
            for layer_idx, latent in enumerate(make_layers(meta)):
                sender.send_layer(meta.request_id, layer_idx, latent)
            sender.finish(meta.request_id, make_extras(meta))
        for meta in metas:
            receiver.wait(meta.request_id, WAIT_S)
            receiver.release(meta.request_id)
        assert sender.flush(WAIT_S) == {}
        assert wait_until(lambda: receiver.num_segments == 0 and own_segment_mappings() == 0)
    finally:
        sender.close()
        receiver.close()


def test_a_sender_whose_receiver_is_unreachable_refuses_each_begin(tmp_path):
    sender = ShmKVSender(str(tmp_path / "nobody.sock"))
    with pytest.raises(ConnectionError, match="unreachable .*must share a host"):
        sender.begin(dataclasses.replace(make_handoff("x"), secret=b"s" * 32))
    assert sender.pending_request_ids() == []
    sender.close()


def _handoff(receiver, sender, request_id: str, meta=None) -> None:
    """One clean handoff (`meta`, else a default one named `request_id`) from `sender` to `receiver`,
    checked bit-exact and released."""
    meta = meta or make_handoff(request_id)
    layers = make_layers(meta)
    bound = receiver.expect(meta)
    sender.begin(bound)
    for layer_idx, latent in enumerate(layers):
        sender.send_layer(meta.request_id, layer_idx, latent)
    sender.finish(meta.request_id, make_extras(meta))
    received = receiver.wait(meta.request_id, WAIT_S)
    assert all(bits_equal(got.latent, sent) for got, sent in zip(received.layers, layers, strict=True))
    receiver.release(meta.request_id)


def test_multi_chunk_layers_arrive_bit_exact_and_a_flip_in_a_later_chunk_is_caught():
    """Layers of several `COPY_CHUNK_BYTES` chunks (copied and CRC-32C'd chunk by chunk on both sides):
    a clean handoff arrives bit-exact; a byte flipped in the segment in layer 1's third chunk, after the
    sender checksummed it, is a ChecksumMismatch naming layer 1, on decode and in the sender's flush."""
    num_tokens = 3 * COPY_CHUNK_BYTES // (576 * 2) + 11  # bf16 [num_tokens, 576]: 3 chunks and a bit
    clean = make_handoff("multi-chunk", num_layers=3, num_tokens=num_tokens, kv_dim=576)
    corrupt = make_handoff("multi-chunk-corrupt", num_layers=3, num_tokens=num_tokens, kv_dim=576)
    layers = make_layers(clean)
    receiver = ShmKVReceiver()
    sender = ShmKVSender(receiver.address, fault_hook=flip_byte_in_layer(1, 2 * COPY_CHUNK_BYTES + 5))
    clean_sender = ShmKVSender(receiver.address)
    try:
        _handoff(receiver, clean_sender, clean.request_id, clean)
        assert clean_sender.flush(WAIT_S) == {}

        bound = receiver.expect(corrupt)
        sender.begin(bound)
        for layer_idx, latent in enumerate(layers):
            sender.send_layer(corrupt.request_id, layer_idx, latent)
        sender.finish(corrupt.request_id, make_extras(corrupt))
        with pytest.raises(ChecksumMismatch, match="layer 1"):
            receiver.wait(corrupt.request_id, WAIT_S)
        failures = sender.flush(WAIT_S)
        assert list(failures) == [corrupt.request_id]
        assert isinstance(failures[corrupt.request_id], ChecksumMismatch)
        receiver.release(corrupt.request_id)
    finally:
        sender.close()
        clean_sender.close()
        receiver.close()
    assert pdcluster_shm_entries() == set()


def test_try_send_never_waits_for_a_peer_that_is_behind():
    """`Channel.try_send` (how `send_layer` sends a header from prefill's engine thread) returns False once
    the socket's buffer is full instead of blocking, and sends again once the peer has read; a record over
    one packet is refused. A False sends nothing: the peer gets exactly the records that returned True."""
    import socket

    from pdcluster.kvtransfer.shm_transport.channel import MAX_PACKET_BYTES, Channel

    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender, peer = Channel(left), Channel(right)
    try:
        sent = 0
        while sender.try_send({"k": "layer", "n": sent}):
            sent += 1
            assert sent < 1_000_000, "the buffer never filled"
        assert not sender.try_send({"k": "layer", "n": sent})  # still full: no wait, no send
        assert [peer.recv()[0]["n"] for _ in range(sent)] == list(range(sent))
        assert sender.try_send({"k": "layer", "n": sent})
        assert peer.recv()[0]["n"] == sent
        with pytest.raises(ValueError, match="more than one packet"):
            sender.try_send({"k": "layer", "blob": b"x" * MAX_PACKET_BYTES})
    finally:
        sender.close()
        peer.close()


def test_a_sender_whose_connection_ended_reconnects_at_its_next_begin():
    """Decode drops the sender's connection (its connection thread closes it): the handoff open then fails
    with SenderLost, and the next `begin` connects again instead of queueing onto a dead socket forever
    (found by an attack that ran decode out of descriptors: every later request waited out two leases)."""
    receiver = ShmKVReceiver()
    sender = ShmKVSender(receiver.address)
    try:
        _handoff(receiver, sender, "before")
        assert sender.flush(WAIT_S) == {}  # its done record has arrived: flush(0.0) below sees only "open"
        open_meta = make_handoff("open")
        sender.begin(receiver.expect(open_meta))
        assert wait_until(lambda: receiver._connections)
        receiver._connections[0].channel.close()  # what decode does to a connection it gives up on
        assert wait_until(lambda: open_meta.request_id in sender.flush(0.0))
        receiver.release(open_meta.request_id)
        _handoff(receiver, sender, "after")
        assert sender.flush(WAIT_S) == {}
    finally:
        sender.close()
        receiver.close()


def test_a_begin_after_a_failed_send_reconnects_before_the_reader_noticed(monkeypatch):
    """The worker's send fails first (decode closed the connection before `begin` went out) while the
    reader has not yet seen the close: once flush reports the handoff lost, the next `begin` still
    connects again instead of queueing onto the closed socket (CI saw "after" wait out its lease)."""
    from pdcluster.kvtransfer.shm_transport import sender as sender_module

    reader_may_run = threading.Event()
    reader_may_run.set()
    real_wait_readable = sender_module.wait_readable

    def held_wait_readable(sock, timeout_s):
        reader_may_run.wait()
        return real_wait_readable(sock, timeout_s)

    monkeypatch.setattr(sender_module, "wait_readable", held_wait_readable)
    receiver = ShmKVReceiver()
    sender = ShmKVSender(receiver.address)
    try:
        _handoff(receiver, sender, "before")
        assert sender.flush(WAIT_S) == {}
        assert wait_until(lambda: receiver._connections)
        reader_may_run.clear()
        time.sleep(2 * sender_module.POLL_S)  # the reader is now held before its next poll
        receiver._connections[0].channel.close()
        open_meta = make_handoff("open")
        sender.begin(receiver.expect(open_meta))  # the worker's send of it fails
        assert wait_until(lambda: open_meta.request_id in sender.flush(0.0))
        receiver.release(open_meta.request_id)
        threading.Timer(0.2, reader_may_run.set).start()
        _handoff(receiver, sender, "after")
        assert sender.flush(WAIT_S) == {}
    finally:
        reader_may_run.set()
        sender.close()
        receiver.close()


def test_descriptors_past_1024_work():
    """With this process's descriptors 0..1100 taken, the receiver's and sender's sockets get numbers past
    1024, which `select()` refuses (the attack's decode crashed its connection threads so): a handoff still
    completes."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"RLIMIT_NOFILE {soft} < 1200")
    filler = []
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        receiver = ShmKVReceiver()
        sender = ShmKVSender(receiver.address)
        try:
            assert sender._channel.sock.fileno() > 1024
            _handoff(receiver, sender, "high-fd")
            assert sender.flush(WAIT_S) == {}
        finally:
            sender.close()
            receiver.close()
    finally:
        for fd in filler:
            os.close(fd)


def test_connections_past_the_cap_are_closed_and_oversized_records_cut_off():
    """A receiver serves at most `max_connections` connections (one thread each): one more is closed at
    accept while the others go on; a record of more than MAX_RECORD_BYTES closes its connection rather than
    being buffered. A clean handoff works afterwards."""

    from pdcluster.kvtransfer.shm_transport.channel import MAX_PACKET_BYTES, MAX_RECORD_BYTES, connect

    receiver = ShmKVReceiver(max_connections=2)
    sender = ShmKVSender(receiver.address)
    idle = connect(receiver.address)
    extra = connect(receiver.address)
    try:
        assert wait_until(lambda: len(receiver._connections) == 2)
        extra.sock.settimeout(WAIT_S)
        assert extra.sock.recv(1) == b""  # closed by the receiver
        idle.close()
        assert wait_until(lambda: len(receiver._connections) == 1)
        flood = connect(receiver.address)
        flood.sock.settimeout(WAIT_S)
        with pytest.raises(OSError):  # the receiver closes it mid-record: a send fails
            for _ in range(MAX_RECORD_BYTES // MAX_PACKET_BYTES + 2):
                flood.sock.send(b"M" + b"x" * MAX_PACKET_BYTES)
            flood.sock.send(b"E")
            assert flood.sock.recv(1) == b""  # or it reads the close
            raise OSError("closed")
        flood.close()
        _handoff(receiver, sender, "after-flood")
        assert sender.flush(WAIT_S) == {}
    finally:
        extra.close()
        sender.close()
        receiver.close()


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_sent_to_decode_never_reach_it_and_a_record_cannot_pile_them_up():
    """Senders never pass descriptors, so decode's receiver takes none (the kernel closes what a peer
    sends) and closes the connection. Before, a record's unfinished packets (flag M) could each bring 4,
    kept until the record ended: an attack held 20,000 and the receiver's thread then died on EMFILE. On a
    channel that does take descriptors, any on a record's later packet cut it off and all are closed."""
    import socket

    from pdcluster.kvtransfer.base import ProtocolError
    from pdcluster.kvtransfer.shm_transport.channel import Channel, connect

    receiver = ShmKVReceiver()
    sender = ShmKVSender(receiver.address)
    read_end, write_end = os.pipe()
    try:
        assert wait_until(lambda: len(receiver._connections) == 1)
        baseline = _open_descriptors()
        attacker = connect(receiver.address)
        attacker.sock.settimeout(WAIT_S)
        with pytest.raises(OSError):  # closed by the receiver at the first packet
            for _ in range(200):
                socket.send_fds(attacker.sock, [b"M" + b"x" * 16], [read_end, write_end, read_end, write_end])
            assert attacker.sock.recv(1) == b""
            raise OSError("closed")
        attacker.close()
        assert wait_until(lambda: len(receiver._connections) == 1 and _open_descriptors() == baseline)
        _handoff(receiver, sender, "after-descriptors")
        assert sender.flush(WAIT_S) == {}

        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        peer = Channel(right)
        try:
            baseline = _open_descriptors()
            socket.send_fds(left, [b"M" + b"x"], [read_end])  # the first packet may bring some
            socket.send_fds(left, [b"M" + b"y"], [write_end])  # a later one may not
            with pytest.raises(ProtocolError, match="later packet"):
                peer.recv()
            assert _open_descriptors() == baseline
        finally:
            left.close()
            peer.close()
    finally:
        os.close(read_end)
        os.close(write_end)
        sender.close()
        receiver.close()


def test_the_sender_closes_every_descriptor_decode_sends_that_it_does_not_map(caplog):
    """Prefill's side of the channel takes descriptors (decode's segment grants). Each one it does not keep
    is closed: a second descriptor on a grant, one on a record that is not a grant, one on a malformed
    grant, one whose file is smaller than the capacity granted (mapped, a write past the file's end would
    kill the process with SIGBUS). A valid grant's segment is mapped, and a second grant under its id
    replaces the mapping."""
    import shutil

    from pdcluster.kvtransfer.shm_transport.channel import SOCKET_NAME, Channel, listen
    from pdcluster.kvtransfer.shm_transport.segments import anonymous_fd

    listener, directory = listen()
    sender = ShmKVSender(str(directory / SOCKET_NAME))
    conn, _ = listener.accept()
    decode = Channel(conn)
    try:
        baseline = _open_descriptors()
        mib = 1 << 20

        def send(record: dict, *sizes: int) -> None:
            fds = [anonymous_fd(size) for size in sizes]
            try:
                decode.send(record, fds)  # the kernel gives the sender its own copies
            finally:
                for fd in fds:
                    os.close(fd)

        send({"k": "grant", "rid": "a", "seg": 1, "cap": mib}, mib, mib)  # one extra descriptor
        send({"k": "done", "rid": "a", "error": None}, mib)  # a descriptor on a record that is no grant
        send({"k": "grant", "rid": "a", "seg": 2}, mib)  # no capacity
        send({"k": "grant", "rid": "a", "seg": 3, "cap": "1"}, mib)  # a capacity that is no int
        send({"k": "grant", "rid": "a", "seg": 4, "cap": 4 * mib}, mib)  # more than the file holds
        assert wait_until(lambda: 1 in sender._mapped.segments)
        first = sender._mapped.segments[1]
        send({"k": "grant", "rid": "a", "seg": 1, "cap": 2 * mib}, 2 * mib)  # replaces segment 1
        assert wait_until(lambda: sender._mapped.segments.get(1) is not first)
        # One left: the mapping of segment 1 (Python's mmap keeps a duplicate of the descriptor it maps).
        assert wait_until(lambda: _open_descriptors() == baseline + 1), (_open_descriptors(), baseline)
        assert set(sender._mapped.segments) == {1} and sender._mapped.segments[1].capacity_bytes == 2 * mib
        sender._mapped.segments[1].view(0, 2 * mib).numpy()[:] = 7  # every byte granted can be written
        malformed = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert len(malformed) == 3 and "fewer than the 4194304 B granted" in malformed[-1]
    finally:
        sender.close()
        decode.close()
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_segment_that_cannot_be_made_fails_its_handoff_only(monkeypatch, caplog):
    """Out of descriptors or memory when decode makes a handoff's segment (injected: `SegmentPool.acquire`
    raises EMFILE once): that handoff fails on both sides, naming the cause, and the connection serves the
    next one. Malformed records are dropped with one log line per interval, not one each."""
    import errno
    import logging

    from pdcluster.kvtransfer.base import KVTransferError
    from pdcluster.kvtransfer.shm_transport.channel import connect
    from pdcluster.kvtransfer.shm_transport.segments import SegmentPool

    real_acquire = SegmentPool.acquire
    calls = []

    def acquire_failing_once(self, num_bytes):
        calls.append(num_bytes)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_acquire(self, num_bytes)

    monkeypatch.setattr(SegmentPool, "acquire", acquire_failing_once)
    receiver = ShmKVReceiver()
    sender = ShmKVSender(receiver.address)
    try:
        meta = make_handoff("no-segment")
        sender.begin(receiver.expect(meta))
        for layer_idx, latent in enumerate(make_layers(meta)):
            sender.send_layer(meta.request_id, layer_idx, latent)
        sender.finish(meta.request_id, make_extras(meta))
        with pytest.raises(KVTransferError, match="could not map .*Too many open files"):
            receiver.wait(meta.request_id, WAIT_S)
        failures = sender.flush(WAIT_S)
        assert list(failures) == [meta.request_id]
        assert "could not map" in str(failures[meta.request_id])
        receiver.release(meta.request_id)
        _handoff(receiver, sender, "next")
        assert sender.flush(WAIT_S) == {}

        noisy = connect(receiver.address)
        with caplog.at_level(logging.WARNING, logger="pdcluster.kvtransfer.shm_transport.receiver"):
            for _ in range(50):
                noisy.send({"k": "layer"})  # no header: KeyError, dropped
            noisy.send({"k": "end", "rid": "nothing"})  # processed after all 50: the connection is alive
            assert wait_until(lambda: len(receiver._connections) == 2)
            _handoff(receiver, sender, "beside-the-noise")
            noisy.close()  # its thread reads every record sent, then the end of file, and goes
            assert wait_until(lambda: len(receiver._connections) == 1)
        lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "dropped 1 malformed record(s)" in lines[0]
    finally:
        sender.close()
        receiver.close()
