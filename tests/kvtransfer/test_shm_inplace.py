"""The shm transport writing in place (`shm_transport.inplace`): prefill copies each layer into decode's
shared KV cache through the reservation's block table, decode verifies the CRC-32C of what its blocks hold,
and decode's blocks are never freed while the sender may still write them (the fence).

Senders that get stopped or killed are real spawned processes; decode is this test process."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from pdcluster.kernels.paged_mla import gather_kv
from pdcluster.kvtransfer.base import ChecksumMismatch, TransferTimeout
from pdcluster.kvtransfer.shm_transport import ShmKVReceiver, ShmKVSender
from pdcluster.kvtransfer.shm_transport.inplace import CacheLayout, SharedKVCache, stored_checksum
from pdcluster.kvtransfer.wire import checksum, meta_from_dict, meta_to_dict
from tests.kvtransfer.conftest import bits_equal, flip_byte_in_layer, make_extras, make_handoff, make_layers
from tests.kvtransfer.test_shm_transport import pdcluster_shm_entries, wait_until

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux memfd segments")

WAIT_S = 30.0  # bound on waits that end much sooner; never a measured threshold
BLOCK_SIZE = 16
NUM_BLOCKS = 40


def _cache(meta) -> SharedKVCache:
    return SharedKVCache.for_tensors(meta.num_layers, (NUM_BLOCKS, BLOCK_SIZE, meta.kv_dim), meta.torch_dtype)


def _table(meta, seed: int = 0, spare: int = 0) -> list[int]:
    """The prompt's blocks in a shuffled order (as a cache that has served requests hands them out), and
    `spare` more (decode reserves room for the first token and drafts too)."""
    needed = -(-meta.num_tokens // BLOCK_SIZE) + spare
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:needed].tolist()


def test_an_in_place_handoff_lands_bit_exact_in_the_reserved_blocks_only():
    """No segment, no on_layer call: the layers are in the blocks of the table, bit-exact, and every
    other block is as it was; the fence is over once the handoff is delivered."""
    meta = make_handoff("in-place", num_tokens=100)  # 6 full blocks and a partial one
    cache = _cache(meta)
    for layer in cache.layers:
        layer.fill_(7)
    before = [layer.clone() for layer in cache.layers]
    receiver = ShmKVReceiver()
    receiver.share_kv_cache(cache)
    sender = ShmKVSender(receiver.address)
    called: list[int] = []
    table = _table(meta, spare=2)  # two blocks past the prompt's, as a reservation with drafts may hold
    try:
        layers = make_layers(meta)
        bound = receiver.expect(meta, lambda i, layer: called.append(i), block_ids=table)
        sender.begin(bound)
        for layer_idx, latent in enumerate(layers):
            sender.send_layer(meta.request_id, layer_idx, latent)
        sender.finish(meta.request_id, make_extras(meta))
        received = receiver.wait(meta.request_id, WAIT_S)
        assert sender.flush(WAIT_S) == {}
        assert received.layers == [] and called == [] and receiver.num_segments == 0
        prompt_blocks = table[: -(-meta.num_tokens // BLOCK_SIZE)]
        ids, last = torch.tensor(prompt_blocks), prompt_blocks[-1]
        for layer_idx, latent in enumerate(layers):
            got, _ = gather_kv(cache.layers[layer_idx], ids, meta.num_tokens)
            assert bits_equal(got, latent), layer_idx
            untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)  # the spare blocks included
            untouched[ids] = False
            assert torch.equal(cache.layers[layer_idx][untouched], before[layer_idx][untouched])
            tail = cache.layers[layer_idx][last, meta.num_tokens % BLOCK_SIZE :]  # past the prompt
            assert torch.equal(tail, before[layer_idx][last, meta.num_tokens % BLOCK_SIZE :])
        assert wait_until(lambda: receiver.num_fenced == 0)
        receiver.release(meta.request_id)
        assert receiver.defer_until_writes_end(meta.request_id, lambda: None) is False
    finally:
        sender.close()
        receiver.close()


def test_stored_checksum_is_the_crc_of_the_tensor_written():
    meta = make_handoff("crc", num_tokens=37)
    cache = _cache(meta)
    latent = make_layers(meta)[0]
    table = _table(meta, seed=3)
    from pdcluster.kernels.paged_mla import write_prompt_kv

    crc = write_prompt_kv(cache.layers[0], latent, torch.tensor(table), checksum_start=0)
    assert crc == checksum(latent.view(torch.uint8).numpy())
    assert stored_checksum(cache.layers[0], torch.tensor(table).numpy(), meta.num_tokens) == crc


def test_a_corrupted_in_place_layer_fails_the_handoff_and_its_blocks_wait_for_the_senders_end():
    """A byte flipped in decode's blocks after the sender checksummed it: ChecksumMismatch naming the
    layer on both sides; decode frees the blocks once the sender said it stopped (its `end`)."""
    meta = make_handoff("in-place-corrupt", num_tokens=100)
    receiver = ShmKVReceiver()
    receiver.share_kv_cache(_cache(meta))
    sender = ShmKVSender(receiver.address, fault_hook=flip_byte_in_layer(1, 40))
    freed = threading.Event()
    try:
        bound = receiver.expect(meta, block_ids=_table(meta))
        sender.begin(bound)
        for layer_idx, latent in enumerate(make_layers(meta)):
            sender.send_layer(meta.request_id, layer_idx, latent)
        sender.finish(meta.request_id, make_extras(meta))
        with pytest.raises(ChecksumMismatch, match="layer 1 written in place"):
            receiver.wait(meta.request_id, WAIT_S)
        receiver.release(meta.request_id)
        failures = sender.flush(WAIT_S)
        assert isinstance(failures[meta.request_id], ChecksumMismatch)
        if receiver.defer_until_writes_end(meta.request_id, freed.set):  # the end may be here already
            assert freed.wait(WAIT_S)
        assert receiver.num_fenced == 0
    finally:
        sender.close()
        receiver.close()


def _stopping_sender(address: str, pipe, num_layers: int) -> None:
    """Prefill in its own process: once connected, takes the bound handoff from `pipe` (decode's lease
    starts only then: spawning may take seconds on a loaded machine), sends `num_layers` layers in place,
    then stops itself (SIGSTOP: every thread, at once, well inside its lease); the test resumes or kills
    it."""
    sender = ShmKVSender(address)
    pipe.send("connected")
    meta = meta_from_dict(pipe.recv())
    sender.begin(meta)
    while sender._requests[meta.request_id].blocks is None:  # granted in place
        time.sleep(0.001)
    for layer_idx, latent in enumerate(make_layers(meta)[:num_layers]):
        sender.send_layer(meta.request_id, layer_idx, latent)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"T"


@pytest.mark.parametrize("then", ["resumed", "killed"])
def test_blocks_of_a_stopped_sender_stay_reserved_past_its_lease_until_it_ends_or_dies(then):
    """The sender stops (SIGSTOP) mid-handoff: decode's lease runs out (TransferTimeout), and decode may
    not free the blocks, since the sender could still write them when it runs again. Resumed, its own
    lease check ends the handoff and tells decode (`end`); killed, its connection ends: either way the
    blocks are freed then, and nothing is left in /dev/shm."""
    before = pdcluster_shm_entries()
    lease_s = 2.0
    meta = make_handoff(f"stopped-{then}", num_tokens=300, lease_s=lease_s)
    receiver = ShmKVReceiver()
    receiver.share_kv_cache(_cache(meta))
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_stopping_sender, args=(receiver.address, theirs, 2))
    child.start()
    freed = threading.Event()
    try:
        assert ours.poll(WAIT_S) and ours.recv() == "connected"
        ours.send(meta_to_dict(receiver.expect(meta, block_ids=_table(meta))))
        assert wait_until(lambda: receiver.num_fenced == 1 and _stopped(child.pid))  # granted in place
        with pytest.raises(TransferTimeout):
            receiver.wait(meta.request_id, WAIT_S)
        receiver.release(meta.request_id)
        assert receiver.defer_until_writes_end(meta.request_id, freed.set)
        assert not freed.wait(lease_s)  # past the lease on both sides: still held
        if then == "resumed":
            os.kill(child.pid, signal.SIGCONT)
        else:
            os.kill(child.pid, signal.SIGKILL)
        assert freed.wait(WAIT_S)
        assert receiver.num_fenced == 0 and receiver.num_segments == 0
        assert pdcluster_shm_entries() == before
    finally:
        child.kill()
        child.join(WAIT_S)
        receiver.close()


def test_a_cache_layout_record_is_checked():
    good = CacheLayout(2, 8, 16, 24, "bfloat16")
    assert CacheLayout.from_dict(good.to_dict()) == good
    assert good.total_bytes == 2 * 8 * 16 * 24 * 2
    for bad in ({**good.to_dict(), "blocks": 0}, {**good.to_dict(), "kv_dim": "24"}):
        with pytest.raises(TypeError):
            CacheLayout.from_dict(bad)
    with pytest.raises(ValueError, match="unknown dtype"):
        CacheLayout.from_dict({**good.to_dict(), "dtype": "int8"})


def test_a_receiver_closed_mid_handoff_frees_the_blocks_once_the_sender_stopped_writing():
    """Decode closes its receiver (a rewire, a shutdown) while an in-place handoff is open and its sender
    alive: decode half-closes, the sender sees the end, stops writing and closes its side, and only then
    do the blocks go back (the fence lives with the cache, not the receiver)."""
    meta = make_handoff("receiver-closed", num_tokens=100, lease_s=60.0)
    cache = _cache(meta)
    receiver = ShmKVReceiver()
    receiver.share_kv_cache(cache)
    sender = ShmKVSender(receiver.address)
    freed = threading.Event()
    try:
        bound = receiver.expect(meta, block_ids=_table(meta))
        sender.begin(bound)
        assert wait_until(lambda: sender._requests[meta.request_id].granted.is_set())  # nothing sent yet
        receiver.release(meta.request_id)
        assert receiver.defer_until_writes_end(meta.request_id, freed.set)
        receiver.close()
        assert freed.wait(WAIT_S)
        assert len(cache.fences) == 0
        failures = sender.flush(WAIT_S)
        assert type(failures[meta.request_id]).__name__ == "SenderLost"
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(
    ("what", "grant_of"),
    [
        ("a block id past the cache", lambda meta, good: {"blocks": [NUM_BLOCKS] + good[1:]}),
        ("a block id past int64", lambda meta, good: {"blocks": [2**64 - 1] + good[1:]}),
        ("too few blocks", lambda meta, good: {"blocks": good[:1]}),
        ("not a list of ints", lambda meta, good: {"blocks": "0,1"}),
        ("an unsealed cache file", None),
    ],
)
def test_an_unusable_in_place_grant_fails_that_handoff_only_and_writes_nothing(what, grant_of):
    """A receiver (here a raw socket standing in for a faulty or forged decode) grants in place with a
    table or a cache the sender cannot use: that handoff fails (ProtocolError, and the receiver is told
    with `end`), nothing is written, and the sender's threads go on: its next handoff on the same
    connection is granted with a good table and delivered."""
    from pdcluster.kvtransfer.base import ProtocolError
    from pdcluster.kvtransfer.shm_transport.channel import Channel, listen
    from pdcluster.kvtransfer.shm_transport.segments import anonymous_fd

    bad, good_meta = (
        dataclasses.replace(make_handoff(name, num_tokens=100), secret=b"s" * 32) for name in ("bad", "good")
    )
    listener, directory = listen()
    sender = ShmKVSender(str(directory / "kv.sock"))
    cache = _cache(bad)
    unsealed_fd = anonymous_fd(cache.layout.total_bytes)  # the same size, no seals
    try:
        sock, _ = listener.accept()
        decode = Channel(sock)
        sender.begin(bad)
        record, _ = decode.recv()
        assert record["k"] == "begin"
        good = _table(bad)
        grant = {"k": "grant", "rid": bad.request_id, "cache": cache.layout.to_dict()}
        if grant_of is None:
            decode.send({**grant, "blocks": good}, [unsealed_fd])
        else:
            decode.send({**grant, **grant_of(bad, good)}, [cache.fd])
        record, _ = decode.recv()
        assert record == {"k": "end", "rid": bad.request_id}, record
        failures = sender.flush(WAIT_S)
        assert isinstance(failures[bad.request_id], ProtocolError), failures
        assert "in-place grant is unusable" in str(failures[bad.request_id])
        assert all(int(layer.abs().sum()) == 0 for layer in cache.layers)  # nothing written

        sender.begin(good_meta)  # the same connection: its reader and worker are alive
        record, _ = decode.recv()
        assert record["k"] == "begin" and record["meta"]["request_id"] == good_meta.request_id
        grant = {"k": "grant", "rid": good_meta.request_id, "blocks": good}
        if grant_of is None:  # the unsealed cache was refused: this connection has none yet
            grant["cache"] = cache.layout.to_dict()
            decode.send(grant, [cache.fd])
        else:
            decode.send(grant)
        latent = make_layers(good_meta)[0]
        sender.send_layer(good_meta.request_id, 0, latent)
        record, _ = decode.recv()
        crc = checksum(latent.view(torch.uint8).numpy())
        assert record["k"] == "layer" and record["h"]["checksum"] == crc
        got, _ = gather_kv(cache.layers[0], torch.tensor(good), good_meta.num_tokens)
        assert bits_equal(got, latent)
        sender.abort(good_meta.request_id, "test over")
    finally:
        os.close(unsealed_fd)
        sender.close()
        listener.close()
