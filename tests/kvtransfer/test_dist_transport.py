"""torch.distributed transport between two real processes (gloo on 127.0.0.1, world size 2).

One `torch.multiprocessing.spawn` runs every scenario in sequence (rank 0 sends, rank 1 receives), so the
two interpreter start-ups are paid once; each scenario writes what it observed to a JSON file and the test
functions below assert on it. A multiprocessing barrier makes decode `expect` before prefill `begin`s, and
a multiprocessing queue carries each handoff's secret from decode's `expect` to prefill (Ray does in the
cluster). Faults come only from the sender's fault hook, chosen per request id; forged and replayed
begins are sent by rank 0 with the transport's own framing (`send_message`), as a process in the group
that is not the real sender could.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.kv_quant import quantize_kv_int8
from kvtransfer.base import (
    ChecksumMismatch,
    HandoffRefused,
    SenderLost,
    TransferAborted,
    TransferTimeout,
    new_handoff_secret,
)
from kvtransfer.dist_transport import (
    DistKVReceiver,
    DistKVSender,
    DistTransportConfig,
    init_transport_group,
    rendezvous_store,
    send_message,
)
from kvtransfer.wire import encode_layer, extras_to_dict, meta_to_dict
from tests.kvtransfer.conftest import (
    GatedCallback,
    assert_extras_equal,
    bits_equal,
    flip_byte_in_layer,
    make_extras,
    make_handoff,
    make_layers,
    stall_after,
)

SENDER_RANK, RECEIVER_RANK = 0, 1
WAIT_S = 10.0  # generous bound on waits that end much sooner; never a measured threshold
# Each scenario's handoff. Leases are long except where the lease itself is under test.
HANDOFFS = {
    "bitexact": make_handoff("bitexact", num_tokens=300),
    "overlap": make_handoff("overlap"),
    "corrupt": make_handoff("corrupt"),
    "stall": make_handoff("stall", lease_s=1.0),
    "abort": make_handoff("abort"),
    "int8": make_handoff("int8", dtype="float32", wire_dtype="int8"),
    "lost": make_handoff("lost"),
    "forged": make_handoff("forged"),
    "replayed": make_handoff("replayed"),
}
SCENARIOS = ("bitexact", "corrupt", "stall", "abort", "int8", "forged", "replayed")
FAULTS = {"corrupt": flip_byte_in_layer(3), "stall": stall_after(2)}


def fault_hook(header, payload) -> bool:
    hook = FAULTS.get(header.request_id)
    return True if hook is None else hook(header, payload)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send_all(sender, meta) -> None:
    sender.begin(meta)
    for layer_idx, latent in enumerate(make_layers(meta)):
        sender.send_layer(meta.request_id, layer_idx, latent)
    sender.finish(meta.request_id, make_extras(meta))


def send_raw(record: dict, payload=None) -> None:
    send_message(record, payload, RECEIVER_RANK, None, torch.device("cpu"))


def send_forged_handoff(meta, secret: bytes | None) -> None:
    """A whole handoff in the transport's framing, with `secret` (None: no secret key at all), a layer of
    junk and a forged first token."""
    record = meta_to_dict(dataclasses.replace(meta, secret=secret or b""))
    if secret is None:
        del record["secret"]
    send_raw({"kind": "begin", "meta": record})
    layer = encode_layer(meta, 0, make_layers(meta, seed=99)[0])
    send_raw({"kind": "layer", "header": layer.header.to_dict()}, layer.payload)
    extras = make_extras(meta)
    extras.first_token_id = 666
    send_raw({"kind": "finish", "request_id": meta.request_id, "extras": extras_to_dict(extras)})


def run_sender(sync, gate, secrets_queue, out: dict) -> None:
    sender = DistKVSender(RECEIVER_RANK, DistTransportConfig("gloo", "cpu"), fault_hook=fault_hook)
    for name in SCENARIOS:
        sync.wait()  # decode has called expect()
        meta = dataclasses.replace(HANDOFFS[name], secret=secrets_queue.get(timeout=WAIT_S))
        if name == "forged":  # a wrong secret, none, an empty one; then the real sender
            for secret in (new_handoff_secret(), None, b""):
                send_forged_handoff(meta, secret)
            send_all(sender, meta)
        elif name == "replayed":  # the real begin and two layers, two replayed begins, the rest
            sender.begin(meta)
            layers = make_layers(meta)
            for layer_idx in (0, 1):
                sender.send_layer(meta.request_id, layer_idx, layers[layer_idx])
            sender.flush(WAIT_S)  # the worker is idle: frames from here cannot interleave with its own
            for secret in (meta.secret, new_handoff_secret()):
                send_raw({"kind": "begin", "meta": meta_to_dict(dataclasses.replace(meta, secret=secret))})
            for layer_idx in range(2, meta.num_layers):
                sender.send_layer(meta.request_id, layer_idx, layers[layer_idx])
            sender.finish(meta.request_id, make_extras(meta))
        elif name == "abort":
            sender.begin(meta)
            layers = make_layers(meta)
            sender.send_layer(meta.request_id, 0, layers[0])
            sender.send_layer(meta.request_id, 1, layers[1])
            sender.abort(meta.request_id, "prefill instance draining")
        else:
            send_all(sender, meta)
        out[name] = {"flush": {k: repr(v) for k, v in sender.flush(WAIT_S).items()}}
        sync.wait()  # decode is done with it
    # overlap: decode blocks in its first on_layer until `gate` opens, which happens only after every
    # send_layer/finish here returned; were send_layer blocking until delivery, the thread would hang.
    sync.wait()
    meta = dataclasses.replace(HANDOFFS["overlap"], secret=secrets_queue.get(timeout=WAIT_S))
    sending = threading.Thread(target=send_all, args=(sender, meta))
    sending.start()
    sending.join(WAIT_S)
    out["overlap"] = {"send_returned_before_delivery": not sending.is_alive()}
    gate.set()
    sync.wait()
    # lost: begin and two layers, then close() without finish
    sync.wait()
    meta = dataclasses.replace(HANDOFFS["lost"], secret=secrets_queue.get(timeout=WAIT_S))
    sender.begin(meta)
    for layer_idx, latent in enumerate(make_layers(meta)[:2]):
        sender.send_layer(meta.request_id, layer_idx, latent)
    sender.close()
    out["sender_pending_after_close"] = sender.pending_request_ids()
    sync.wait()


def expect_error(receiver, meta, error_type) -> dict:
    try:
        receiver.wait(meta.request_id, WAIT_S)
        return {"raised": None}
    except error_type as e:
        return {"raised": type(e).__name__, "message": str(e)}
    finally:
        receiver.release(meta.request_id)


def run_receiver(sync, gate, secrets_queue, out: dict) -> None:
    receiver = DistKVReceiver([SENDER_RANK], DistTransportConfig("gloo", "cpu"))
    for name in SCENARIOS:
        meta = receiver.expect(HANDOFFS[name])
        secrets_queue.put(meta.secret)
        expected_at_s = time.monotonic()
        sync.wait()
        if name in ("bitexact", "int8", "forged", "replayed"):
            received = receiver.wait(meta.request_id, WAIT_S)
            layers = make_layers(meta)
            result = {"num_wire_bytes": received.num_wire_bytes}
            if name != "int8":
                result["bit_exact"] = all(
                    bits_equal(r.latent, x) for r, x in zip(received.layers, layers, strict=True)
                )
            else:
                errors = [(r.latent - x).abs() for r, x in zip(received.layers, layers, strict=True)]
                bounds = [x.abs().amax(dim=-1, keepdim=True) / 127 / 2 for x in layers]
                result["within_bound"] = all(
                    bool((e <= b * (1 + 1e-6)).all()) for e, b in zip(errors, bounds, strict=True)
                )
                result["dtype"] = str(received.layers[0].latent.dtype)
            assert_extras_equal(received.extras, make_extras(meta))
            receiver.release(meta.request_id)
        else:
            error_type = {"corrupt": ChecksumMismatch, "stall": TransferTimeout, "abort": TransferAborted}[
                name
            ]
            result = expect_error(receiver, meta, error_type)
            result["elapsed_s"] = time.monotonic() - expected_at_s
        out[name] = result
        sync.wait()
    slow_decode = GatedCallback(gate=gate)
    meta = receiver.expect(HANDOFFS["overlap"], on_layer=slow_decode)
    secrets_queue.put(meta.secret)
    sync.wait()
    received = receiver.wait(meta.request_id, WAIT_S)
    out["overlap"] = {
        "bit_exact": all(
            bits_equal(slow_decode.layers[i].latent, x) for i, x in enumerate(make_layers(meta))
        ),
        "layers_returned": len(received.layers),
    }
    receiver.release(meta.request_id)
    sync.wait()
    meta = receiver.expect(HANDOFFS["lost"])
    secrets_queue.put(meta.secret)
    sync.wait()
    out["lost"] = expect_error(receiver, meta, SenderLost)
    sync.wait()
    receiver.close()
    out["receiver_pending"] = receiver.pending_request_ids()


def run_rank(rank: int, port: int, result_dir: str, sync, gate, secrets_queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    out: dict = {}
    init_transport_group(
        DistTransportConfig("gloo", "cpu"),
        rank=rank,
        world_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout_s=60,
    )
    try:
        (run_sender if rank == SENDER_RANK else run_receiver)(sync, gate, secrets_queue, out)
    except BaseException:
        out["traceback"] = traceback.format_exc()
        sync.abort()  # wake the other rank instead of letting it hang on the barrier
        raise
    finally:
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    result_dir = tmp_path_factory.mktemp("dist_kv")
    ctx = mp.get_context("spawn")
    sync, gate, secrets_queue = ctx.Barrier(2, timeout=60), ctx.Event(), ctx.Queue()
    try:
        mp.spawn(
            run_rank, args=(free_port(), str(result_dir), sync, gate, secrets_queue), nprocs=2, join=True
        )
    finally:
        for rank in (SENDER_RANK, RECEIVER_RANK):
            path = result_dir / f"rank{rank}.json"
            if path.exists() and "traceback" in json.loads(path.read_text()):
                print(f"rank {rank}:\n{json.loads(path.read_text())['traceback']}")
    return {
        "sender": json.loads((result_dir / f"rank{SENDER_RANK}.json").read_text()),
        "receiver": json.loads((result_dir / f"rank{RECEIVER_RANK}.json").read_text()),
    }


def test_five_layer_handoff_arrives_bit_exact_with_extras(results):
    got = results["receiver"]["bitexact"]
    assert got["bit_exact"]  # extras were compared in the receiver (assert_extras_equal)
    meta = HANDOFFS["bitexact"]
    assert got["num_wire_bytes"] == 5 * meta.num_tokens * meta.kv_dim * torch.bfloat16.itemsize
    assert results["sender"]["bitexact"]["flush"] == {}


def test_send_layer_returns_before_delivery(results):
    assert results["sender"]["overlap"]["send_returned_before_delivery"]
    assert results["receiver"]["overlap"] == {"bit_exact": True, "layers_returned": 0}


def test_corrupted_byte_is_a_checksum_mismatch_naming_the_layer(results):
    got = results["receiver"]["corrupt"]
    assert got["raised"] == "ChecksumMismatch" and "checksum mismatch on layer 3" in got["message"]


def test_sender_that_stalls_after_two_layers_times_out_within_the_lease(results):
    got = results["receiver"]["stall"]
    assert got["raised"] == "TransferTimeout"
    assert "lease of 1 s expired with 2/5 layers arrived" in got["message"]
    assert got["elapsed_s"] < WAIT_S  # the lease fired, not the wait's own timeout


def test_explicit_abort(results):
    got = results["receiver"]["abort"]
    assert got["raised"] == "TransferAborted" and "prefill instance draining" in got["message"]


def test_int8_wire(results):
    got = results["receiver"]["int8"]
    assert got["within_bound"] and got["dtype"] == "torch.float32"
    assert got["num_wire_bytes"] == 5 * (
        37 * 24 * torch.int8.itemsize + 37 * torch.float32.itemsize
    )  # 5,180 B


def test_sender_closing_mid_handoff_fails_it_with_sender_lost(results):
    got = results["receiver"]["lost"]
    assert got["raised"] == "SenderLost" and "2/5 layers arrived" in got["message"]


def test_no_leaked_state_on_either_side(results):
    assert results["receiver"]["receiver_pending"] == []
    assert results["sender"]["sender_pending_after_close"] == []
    for name in SCENARIOS:
        assert name in results["sender"]


def test_forged_begins_for_a_live_id_are_refused_and_the_victim_completes(results):
    """Begins with a wrong, a missing and an empty secret, each followed by a junk layer and a forged
    first token, then the real sender: the handoff arrives bit-exact with the real extras (compared in
    the receiver), and nothing was recorded against it."""
    assert results["receiver"]["forged"]["bit_exact"]
    assert results["sender"]["forged"]["flush"] == {}


def test_replayed_begins_are_refused_and_the_transfer_in_progress_is_unaffected(results):
    assert results["receiver"]["replayed"]["bit_exact"]
    assert results["sender"]["replayed"]["flush"] == {}


def test_data_from_a_rank_not_admitted_to_the_handoff_is_refused_unrecorded():
    """The begin binds the handoff to the peer rank that sent it: a layer, finish or abort for it from
    another rank is dropped (HandoffRefused) and the reservation goes on (no process group needed: the
    receiver's dispatch is called directly, as its receive threads do)."""
    receiver = DistKVReceiver([], DistTransportConfig("gloo", "cpu"))  # no peers: no receive threads
    meta = receiver.expect(make_handoff("bound-to-rank"))
    real, rogue = {"admitted": set()}, {"admitted": set()}

    def dispatch(peer: int, record: dict, payload=None) -> None:
        receiver._dispatch(peer, record, payload, (real if peer == 0 else rogue)["admitted"])

    dispatch(0, {"kind": "begin", "meta": meta_to_dict(meta)})
    layers = make_layers(meta)
    layer = encode_layer(meta, 0, layers[0])
    with pytest.raises(HandoffRefused, match="rank 1, which was not admitted"):
        dispatch(1, {"kind": "layer", "header": layer.header.to_dict()}, layer.payload)
    with pytest.raises(HandoffRefused):
        dispatch(1, {"kind": "abort", "request_id": meta.request_id, "reason": "forged"})
    with pytest.raises(HandoffRefused):
        dispatch(1, {"kind": "begin", "meta": meta_to_dict(meta)})  # the real secret, a second sender
    assert receiver._reservations.failure(meta.request_id) is None
    for layer_idx, latent in enumerate(layers):
        layer = encode_layer(meta, layer_idx, latent)
        dispatch(0, {"kind": "layer", "header": layer.header.to_dict()}, layer.payload)
    dispatch(
        0, {"kind": "finish", "request_id": meta.request_id, "extras": extras_to_dict(make_extras(meta))}
    )
    received = receiver.wait(meta.request_id, WAIT_S)
    assert all(bits_equal(r.latent, x) for r, x in zip(received.layers, layers, strict=True))
    receiver.release(meta.request_id)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on TCP `port` (Linux /proc/net/tcp{,6})."""
    addresses = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                addresses.add(address if width == 32 else socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return addresses


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_rendezvous_store_listens_on_the_given_address_only():
    """torch's own TCPStore listens on every interface whatever `tcp://host` says; ours on host only."""
    port = free_port()
    store = rendezvous_store("127.0.0.1", port, rank=0, world_size=1, timeout_s=WAIT_S)
    store.set("k", b"v")
    assert _listening_addresses(port) == {"127.0.0.1"}
    del store


def test_config_maps_devices_to_backends_and_names_bad_fields():
    assert DistTransportConfig.for_device("cpu") == DistTransportConfig("gloo", "cpu")
    assert DistTransportConfig.for_device("cuda:1") == DistTransportConfig("nccl", "cuda:1")
    assert DistTransportConfig.for_device("npu:0").backend == "hccl"
    with pytest.raises(ValueError, match="device"):
        DistTransportConfig("gloo", "tpu")
    with pytest.raises(ValueError, match="backend"):
        DistTransportConfig("", "cpu")


def test_int8_round_trip_reference_matches_quantizer():
    """The tolerance used above is quantize_kv_int8's own bound (a check of the oracle, not the transport)."""
    x = make_layers(HANDOFFS["int8"])[0]
    q, scale = quantize_kv_int8(x)
    assert bool(((q.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all())


def test_failed_send_is_forgotten_without_flush():
    """No process group: every send fails. The request is dropped once its finish is processed; only
    the error waits for flush (before the fix the request stayed until flush)."""
    sender = DistKVSender(RECEIVER_RANK, DistTransportConfig("gloo", "cpu"))
    meta = dataclasses.replace(HANDOFFS["bitexact"], secret=new_handoff_secret())
    send_all(sender, meta)
    deadline_s = time.monotonic() + WAIT_S
    while sender.pending_request_ids() and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert sender.pending_request_ids() == []
    failures = sender.flush(WAIT_S)
    assert list(failures) == [meta.request_id]
    assert "failed" in str(failures[meta.request_id])
    assert sender.flush(WAIT_S) == {}
    sender.close(join_timeout_s=1.0)
