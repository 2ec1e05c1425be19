"""The KV-transport contract, as scenarios both transports run: a sender role and a receiver role.

Each scenario is one handoff (or two) between a real sender and a real receiver: the receiver `expect`s,
hands the secret to the sender over `secrets` (Ray does in the cluster), both meet at `sync` (a barrier),
and `events` (named after the scenario that uses them) order what happens inside one scenario;
the sender sends, the receiver waits, and each role writes what it observed into its `out` dict under the
scenario's name; `test_transport_contract.py` asserts on those records, the same assertions for every
transport. `contract_pairs.py` runs the roles: gRPC as two threads, torch.distributed as two processes.
Faults come only from the sender's fault hook (chosen per request id) and from a rogue sender made with
the transport's own means (`Transport.forge` / `Transport.replay_begin`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from pdcluster.kernels.kv_quant import dequantize_kv_int8, quantize_kv_int8
from pdcluster.kvtransfer.base import KVReceiver, KVSender, KVTransferError, new_handoff_secret
from tests.kvtransfer.conftest import (
    GatedCallback,
    PagedWriter,
    assert_extras_equal,
    bits_equal,
    flip_byte_in_layer,
    make_extras,
    make_handoff,
    make_layers,
    stall_after,
)

WAIT_S = 10.0  # generous bound on waits that end much sooner; never a measured threshold
# Each scenario's handoff. Leases are long except where the lease itself is under test.
HANDOFFS = {
    "bitexact": make_handoff("bitexact", num_tokens=300),  # 14,400 B a layer: several gRPC chunks
    "concurrent-0": make_handoff("concurrent-0", num_tokens=50),
    "concurrent-1": make_handoff("concurrent-1", num_tokens=51),
    "corrupt": make_handoff("corrupt", num_tokens=200),
    "stall": make_handoff("stall", lease_s=1.0),
    "abort": make_handoff("abort"),
    "int8": make_handoff("int8", dtype="float32", wire_dtype="int8"),
    "int8-cache": make_handoff("int8-cache", wire_dtype="int8"),
    "mismatch": make_handoff("mismatch"),
    "unexpected": make_handoff("unexpected"),
    "forged": make_handoff("forged"),
    "replayed": make_handoff("replayed"),
    "release-midway": make_handoff("release-midway"),
    "overlap": make_handoff("overlap"),
    "lost": make_handoff("lost", lease_s=60.0),
}
# Run in this order; "lost" closes the sender, so it comes last.
SCENARIOS = (
    "bitexact",
    "concurrent",
    "corrupt",
    "stall",
    "abort",
    "int8",
    "int8-cache",
    "mismatch",
    "unexpected",
    "forged",
    "replayed",
    "release-midway",
    "overlap",
    "lost",
)
BIT_EXACT_ORDER = [4, 0, 3, 1, 2]  # layers in any order; the MTP layer first here


def make_fault_hook():
    """A sender's fault hook, chosen per request id; fresh state for each sender (the stall hook counts
    the layers it let through, so two transports in one process must not share one)."""
    faults = {"corrupt": flip_byte_in_layer(3, byte_offset=4321), "stall": stall_after(2)}

    def fault_hook(header, payload) -> bool:
        hook = faults.get(header.request_id)
        return True if hook is None else hook(header, payload)

    return fault_hook


def send_all(sender: KVSender, meta, layers=None, extras=None, order=None) -> None:
    layers = make_layers(meta) if layers is None else layers
    sender.begin(meta)
    for layer_idx in order or range(meta.num_layers):
        sender.send_layer(meta.request_id, layer_idx, layers[layer_idx])
    sender.finish(meta.request_id, make_extras(meta) if extras is None else extras)


def forged_extras(meta):
    extras = make_extras(meta)
    extras.first_token_id = 666
    return extras


class Transport:
    """What a role needs beyond `KVSender`/`KVReceiver`: a rogue sender, by the transport's own means."""

    name: str

    def __init__(self) -> None:
        self.rogue_failures: list[str] = []  # what rogue senders learned, where the transport tells them

    def forge(self, meta, secret: bytes | None) -> None:
        """A whole handoff for `meta.request_id` with `secret` (None: none at all), a junk layer and a
        forged first token, from a sender that is not the real one."""
        raise NotImplementedError

    def replay_begin(self, meta, secret: bytes) -> None:
        """A second sender's begin for a handoff in progress (the real secret: a replay, or another)."""
        raise NotImplementedError


def flushed(sender: KVSender) -> dict[str, str]:
    """`sender.flush`'s failures as `{request_id: "ErrorClass: message"}` (JSON-ready)."""
    return {rid: f"{type(e).__name__}: {e}" for rid, e in sender.flush(WAIT_S).items()}


# ---- sender role ----


# Events between the roles: decode blocks in on_layer until the sender opens "overlap"; decode's on_layer
# sets "replayed" / "lost" once the first layer is on decode; the sender sets "forged" once the forgeries
# are sent and waits for decode's "forged-checked" before the real sender starts.
EVENT_NAMES = ("overlap", "replayed", "lost", "forged", "forged-checked")


def run_sender(transport: Transport, sender: KVSender, sync, events, secrets, out: dict) -> None:
    def bound(name: str):
        return dataclasses.replace(HANDOFFS[name], secret=secrets.get(timeout=WAIT_S))

    for name in SCENARIOS:
        sync.wait()  # decode has called expect() and passed the secret(s)
        if name == "bitexact":
            meta = bound(name)
            send_all(sender, meta, extras=make_extras(meta, with_probs=True), order=BIT_EXACT_ORDER)
        elif name == "concurrent":  # interleaved layers, as two requests in one prefill batch
            metas = [bound("concurrent-0"), bound("concurrent-1")]
            for meta in metas:
                sender.begin(meta)
            layers = [make_layers(meta, seed=i) for i, meta in enumerate(metas)]
            for layer_idx in range(5):
                for meta, lay in zip(metas, layers, strict=True):
                    sender.send_layer(meta.request_id, layer_idx, lay[layer_idx])
            for i, meta in enumerate(metas):
                sender.finish(meta.request_id, make_extras(meta, seed=i))
        elif name == "int8-cache":  # an int8 KV cache's bytes: int8 values + scales, as they are
            meta = bound(name)
            sender.begin(meta)
            for layer_idx, latent in enumerate(make_layers(meta)):
                sender.send_layer(meta.request_id, layer_idx, *quantize_kv_int8(latent))
            sender.finish(meta.request_id, make_extras(meta))
        elif name == "mismatch":  # the reservation's secret, one token more than it
            secret = secrets.get(timeout=WAIT_S)
            wrong = make_handoff("mismatch", num_tokens=HANDOFFS[name].num_tokens + 1, secret=secret)
            send_all(sender, wrong)
        elif name == "unexpected":  # nobody reserved it
            send_all(sender, make_handoff("unexpected", secret=new_handoff_secret()))
        elif name == "forged":  # a wrong secret, none, an empty one; then the real sender
            meta = bound(name)
            for secret in (new_handoff_secret(), None, b""):
                transport.forge(meta, secret)
            events["forged"].set()
            assert events["forged-checked"].wait(WAIT_S)
            send_all(sender, meta)
        elif name == "replayed":  # the real begin and layer 0, two rogue begins, the rest
            meta = bound(name)
            layers = make_layers(meta)
            sender.begin(meta)
            sender.send_layer(meta.request_id, 0, layers[0])
            assert events["replayed"].wait(WAIT_S)  # layer 0 is on decode: the real begin was admitted
            sender.flush(WAIT_S)
            for secret in (meta.secret, new_handoff_secret()):
                transport.replay_begin(meta, secret)
            for layer_idx in range(1, meta.num_layers):
                sender.send_layer(meta.request_id, layer_idx, layers[layer_idx])
            sender.finish(meta.request_id, make_extras(meta))
        elif name == "abort":
            meta = bound(name)
            layers = make_layers(meta)
            sender.begin(meta)
            sender.send_layer(meta.request_id, 0, layers[0])
            sender.send_layer(meta.request_id, 1, layers[1])
            sender.abort(meta.request_id, "prefill instance draining")
            try:
                sender.send_layer(meta.request_id, 2, layers[2])
                out["send_after_abort"] = "accepted"
            except ValueError as e:
                out["send_after_abort"] = str(e)
        elif name == "overlap":  # every send_layer/finish must return while decode is blocked in on_layer
            meta = bound(name)
            sending = threading.Thread(target=send_all, args=(sender, meta))
            sending.start()
            sending.join(WAIT_S)
            out[name] = {"send_returned_before_delivery": not sending.is_alive()}
            events["overlap"].set()
        elif name == "lost":  # begin and one layer, then close() without finish
            meta = bound(name)
            sender.begin(meta)
            sender.send_layer(meta.request_id, 0, make_layers(meta)[0])
            assert events["lost"].wait(WAIT_S)  # layer 0 is on decode: the stream is established
            sender.close()
            out["sender_pending_after_close"] = sender.pending_request_ids()
            out["rogue_failures"] = transport.rogue_failures
        else:
            send_all(sender, bound(name))
        if name != "lost":
            out.setdefault(name, {})["flush"] = flushed(sender)
            out.setdefault(name, {})["pending"] = sender.pending_request_ids()
        sync.wait()  # decode is done with it


# ---- receiver role ----


def _received_bit_exact(received, layers) -> bool:
    pairs = zip(received.layers, layers, strict=True)
    return all(bits_equal(r.latent, x) and r.scale is None for r, x in pairs)


def _within_int8_bound(received, layers) -> bool:
    """quantize_kv_int8's bound: |x - x_hat| <= scale / 2 per element, scale = absmax(row) / 127."""
    bounds = [x.abs().amax(dim=-1, keepdim=True) / 127 / 2 * (1 + 1e-6) for x in layers]
    pairs = zip(received.layers, layers, bounds, strict=True)
    return all(bool(((r.latent - x).abs() <= bound).all()) for r, x, bound in pairs)


def _release_during_callback(receiver: KVReceiver, request_id: str, on_layer: GatedCallback) -> dict:
    """`release` while decode's on_layer runs: it blocks until the callback returned, and none runs after."""
    assert on_layer.entered.wait(WAIT_S)
    released = threading.Event()
    releaser = threading.Thread(target=lambda: (receiver.release(request_id), released.set()))
    releaser.start()
    blocked = not released.wait(0.05)
    on_layer.gate.set()
    releaser.join(WAIT_S)
    return {
        "release_blocked_during_callback": blocked,
        "released": released.is_set(),
        "layers_delivered": len(on_layer.layers),
    }


def _wait_error(receiver: KVReceiver, request_id: str) -> dict[str, Any]:
    started_s = time.monotonic()
    try:
        receiver.wait(request_id, WAIT_S)
        result: dict[str, Any] = {"raised": None}
    except KVTransferError as e:
        result = {"raised": type(e).__name__, "message": str(e)}
    result["elapsed_s"] = time.monotonic() - started_s
    receiver.release(request_id)
    return result


def _still_waiting(receiver: KVReceiver, request_id: str) -> bool:
    """The reservation is alive and incomplete: a short wait times out without failing it."""
    try:
        receiver.wait(request_id, 0.01)
    except KVTransferError as e:
        return "wait timed out" in str(e)
    return False


def run_receiver(receiver: KVReceiver, sync, events, secrets, out: dict) -> None:
    for name in SCENARIOS:
        result: dict[str, Any] = {}
        if name == "concurrent":
            metas = [receiver.expect(HANDOFFS[f"concurrent-{i}"]) for i in range(2)]
            for meta in metas:
                secrets.put(meta.secret)
            sync.wait()
            result["bit_exact"] = []
            for i, meta in enumerate(metas):
                received = receiver.wait(meta.request_id, WAIT_S)
                result["bit_exact"].append(_received_bit_exact(received, make_layers(meta, seed=i)))
                receiver.release(meta.request_id)
        elif name == "unexpected":
            sync.wait()
        else:
            on_layer = None
            if name in ("overlap", "release-midway"):  # a slow decode, until its gate opens
                on_layer = GatedCallback(gate=events["overlap"]) if name == "overlap" else GatedCallback()
            elif name in ("replayed", "lost"):  # tells the sender the first layer is on decode
                on_layer = GatedCallback(entered=events[name])
                on_layer.gate.set()
            elif name in ("bitexact", "corrupt", "int8", "int8-cache"):  # decode's own callback
                on_layer = PagedWriter(HANDOFFS[name])
            meta = receiver.expect(
                HANDOFFS[name], on_layer=on_layer, on_layer_checksums=isinstance(on_layer, PagedWriter)
            )
            secrets.put(meta.secret)
            sync.wait()
            if name in ("bitexact", "forged", "replayed", "overlap", "int8", "int8-cache"):
                if name == "forged":  # before the real sender starts
                    assert events["forged"].wait(WAIT_S)
                    result["still_waiting_after_forgeries"] = _still_waiting(receiver, name)
                    events["forged-checked"].set()
                received = receiver.wait(meta.request_id, WAIT_S)
                layers = make_layers(meta)
                if isinstance(on_layer, PagedWriter):
                    result["layers_returned"] = len(received.layers)
                    result["unverified_when_written"] = sorted(
                        i for i, v in on_layer.verified.items() if not v
                    )
                    received.layers = on_layer.layers()
                elif on_layer is not None:
                    result["layers_returned"] = len(received.layers)
                    received.layers = [on_layer.layers[i] for i in range(meta.num_layers)]
                if name == "int8":  # a float32 model: within quantize_kv_int8's bound
                    result["dtypes"] = sorted({str(r.latent.dtype) for r in received.layers})
                    result["within_bound"] = _within_int8_bound(received, layers)
                elif name == "int8-cache":  # the sender's int8 + scales, dequantized once by this receiver
                    result["bit_exact"] = all(
                        bits_equal(r.latent, dequantize_kv_int8(*quantize_kv_int8(x), meta.torch_dtype))
                        for r, x in zip(received.layers, layers, strict=True)
                    )
                else:
                    result["bit_exact"] = _received_bit_exact(received, layers)
                assert_extras_equal(
                    received.extras, make_extras(meta, with_probs=name == "bitexact")
                )  # the real extras, not a forgery's
                result["num_wire_bytes"] = received.num_wire_bytes
                receiver.release(meta.request_id)
            elif name == "release-midway":
                assert on_layer is not None
                result = _release_during_callback(receiver, meta.request_id, on_layer)
            else:
                result = _wait_error(receiver, meta.request_id)
                if isinstance(on_layer, PagedWriter):  # the corrupted layer was written, then checked
                    result["unverified_when_written"] = sorted(
                        i for i, v in on_layer.verified.items() if not v
                    )
        out[name] = result
        sync.wait()
    out["receiver_pending"] = receiver.pending_request_ids()
