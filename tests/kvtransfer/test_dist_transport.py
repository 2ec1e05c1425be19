"""torch.distributed transport between two real processes (gloo on 127.0.0.1, world size 2).

One `torch.multiprocessing.spawn` runs every scenario in sequence (rank 0 sends, rank 1 receives), so the
two interpreter start-ups are paid once; each scenario writes what it observed to a JSON file and the test
functions below assert on it. A multiprocessing barrier makes decode `expect` before prefill `begin`s.
Faults come only from the sender's fault hook, chosen per request id.
"""

from __future__ import annotations

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
from kvtransfer.base import ChecksumMismatch, SenderLost, TransferAborted, TransferTimeout
from kvtransfer.dist_transport import DistKVReceiver, DistKVSender, DistTransportConfig, init_transport_group
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
}
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


def run_sender(sync, gate, out: dict) -> None:
    sender = DistKVSender(RECEIVER_RANK, DistTransportConfig("gloo", "cpu"), fault_hook=fault_hook)
    for name in ("bitexact", "corrupt", "stall", "abort", "int8"):
        sync.wait()  # decode has called expect()
        meta = HANDOFFS[name]
        if name == "abort":
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
    sending = threading.Thread(target=send_all, args=(sender, HANDOFFS["overlap"]))
    sending.start()
    sending.join(WAIT_S)
    out["overlap"] = {"send_returned_before_delivery": not sending.is_alive()}
    gate.set()
    sync.wait()
    # lost: begin and two layers, then close() without finish
    sync.wait()
    meta = HANDOFFS["lost"]
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


def run_receiver(sync, gate, out: dict) -> None:
    receiver = DistKVReceiver([SENDER_RANK], DistTransportConfig("gloo", "cpu"))
    for name in ("bitexact", "corrupt", "stall", "abort", "int8"):
        meta = HANDOFFS[name]
        receiver.expect(meta)
        expected_at_s = time.monotonic()
        sync.wait()
        if name in ("bitexact", "int8"):
            received = receiver.wait(meta.request_id, WAIT_S)
            layers = make_layers(meta)
            result = {"num_wire_bytes": received.num_wire_bytes}
            if name == "bitexact":
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
    meta = HANDOFFS["overlap"]
    slow_decode = GatedCallback(gate=gate)
    receiver.expect(meta, on_layer=slow_decode)
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
    meta = HANDOFFS["lost"]
    receiver.expect(meta)
    sync.wait()
    out["lost"] = expect_error(receiver, meta, SenderLost)
    sync.wait()
    receiver.close()
    out["receiver_pending"] = receiver.pending_request_ids()


def run_rank(rank: int, port: int, result_dir: str, sync, gate) -> None:
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
        (run_sender if rank == SENDER_RANK else run_receiver)(sync, gate, out)
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
    sync, gate = ctx.Barrier(2, timeout=60), ctx.Event()
    try:
        mp.spawn(run_rank, args=(free_port(), str(result_dir), sync, gate), nprocs=2, join=True)
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
    for name in ("bitexact", "corrupt", "stall", "abort", "int8"):
        assert name in results["sender"]


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
    meta = HANDOFFS["bitexact"]
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
