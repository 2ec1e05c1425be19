"""Receiver-side bookkeeping shared by every transport: reservations, leases, per-layer completion, checksums.

`Reservations` implements `KVReceiver.expect/wait/release/pending_request_ids`; a transport feeds it what
arrives through `claim`, `on_begin`, `on_layer`, `on_finish`, `on_abort` and `on_sender_lost` from its
receive threads. Each `on_*` raises the `KVTransferError` it recorded, so the transport can tell the sender
(gRPC aborts the stream with it) and drop the rest of that request's data.

A reservation moves `expecting -> claimed -> streaming -> complete`, or to `failed` from any state before
`complete`. Only `release` removes it. `claim(request_id, secret)` is how a sender gets in: it succeeds once
per reservation, for the first sender presenting the secret `expect` created (compared with
`hmac.compare_digest`); every other claim raises `HandoffRefused` and changes nothing, so a forged or
replayed sender cannot fail or feed the reservation. The transport then takes data for the request only
from the sender that claimed it (the same gRPC stream; the same torch.distributed peer rank). A layer is
handed to decode (kept, or passed to `on_layer`) only after its header matched the handoff and its
checksum verified, and only while the lease runs; except that an `on_layer` registered with
`on_layer_checksums` (decode writing into reserved blocks nobody reads before admission) gets a float
layer before its checksum is verified, returns the CRC-32C of the bytes it copied, and the layer counts
as arrived only if that matches: one pass over the bytes instead of two (each group of blocks is CRC'd
and then copied from cache). A mismatch fails the handoff as before, and decode frees those blocks unread.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import operator
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdcluster.kvtransfer.base import (
    ChecksumMismatch,
    HandoffExtras,
    HandoffMeta,
    HandoffRefused,
    KVReceiver,
    KVTransferError,
    LayerCallback,
    ProtocolError,
    ReceivedKV,
    ReceivedLayer,
    SenderLost,
    TransferAborted,
    TransferTimeout,
    new_handoff_secret,
)
from pdcluster.kvtransfer.wire import (
    LayerHeader,
    check_header,
    check_payload_length,
    copy_with_checksum,
    decode_layer,
    extras_from_dict,
    verify_layer,
)


class State(enum.Enum):
    EXPECTING = "expecting"  # reserved, no sender yet
    CLAIMED = "claimed"  # a sender presented the secret; its begin is next
    STREAMING = "streaming"  # begin arrived; layers arriving
    COMPLETE = "complete"  # every layer verified and the extras arrived
    FAILED = "failed"


@dataclass
class _Reservation:
    meta: HandoffMeta  # with its secret
    on_layer: LayerCallback | None
    on_layer_checksums: bool  # on_layer returns the CRC-32C of a float layer's bytes; verified after it
    expected_at_s: float  # monotonic time of expect()
    state: State = State.EXPECTING
    layers: list[ReceivedLayer | None] = field(default_factory=list)
    arrived: list[bool] = field(default_factory=list)
    num_layers_arrived: int = 0
    extras: HandoffExtras | None = None
    error: KVTransferError | None = None
    completed_at_s: float = 0.0
    block_ids: list[int] | None = None  # where a same-host sender writes the layers in place (`expect`)
    num_callbacks_running: int = 0

    @property
    def deadline_s(self) -> float:
        return self.expected_at_s + self.meta.lease_s

    def progress(self) -> str:
        return f"{self.num_layers_arrived}/{self.meta.num_layers} layers arrived"


class Reservations:
    """Thread-safe table of one receiver's reservations.

    int8_passthrough: hand int8 + scales through on an int8 wire (a decode instance whose cache is int8:
        `DecodeNode` sets it then) instead of dequantizing to the model dtype.
    copy_kept_layers: a layer kept for `wait` (no `on_layer`) is copied out of the payload (a transport
        whose payload buffers are reused, the shm transport's segments); `on_layer` always gets the
        payload's own views, valid during the call.
    """

    def __init__(self, int8_passthrough: bool = False, copy_kept_layers: bool = False) -> None:
        self.int8_passthrough = int8_passthrough
        self.copy_kept_layers = copy_kept_layers
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._reservations: dict[str, _Reservation] = {}

    # ---- decode side (KVReceiver) ----

    def expect(
        self,
        handoff: HandoffMeta,
        on_layer: LayerCallback | None = None,
        on_layer_checksums: bool = False,
        block_ids: Sequence[int] | None = None,
    ) -> HandoffMeta:
        """Reserve `handoff.request_id`; returns `handoff` bound to it (a fresh secret). See `KVReceiver`."""
        if handoff.secret:
            raise ValueError(
                f"{handoff.request_id}: the handoff already has a secret; the receiver creates it"
            )
        bound = dataclasses.replace(handoff, secret=new_handoff_secret())
        with self._lock:
            if handoff.request_id in self._reservations:
                raise ValueError(f"{handoff.request_id}: already reserved")
            self._reservations[handoff.request_id] = _Reservation(
                meta=bound,
                on_layer=on_layer,
                on_layer_checksums=on_layer is not None and on_layer_checksums,
                expected_at_s=time.monotonic(),
                layers=[None] * handoff.num_layers,
                arrived=[False] * handoff.num_layers,
                block_ids=None if block_ids is None else [int(b) for b in block_ids],
            )
        return bound

    def block_ids(self, request_id: str) -> list[int] | None:
        """The block table given to `expect` (None: none given, or no such reservation)."""
        with self._lock:
            res = self._reservations.get(request_id)
            return None if res is None else res.block_ids

    def wait(self, request_id: str, timeout_s: float) -> ReceivedKV:
        wait_deadline_s = time.monotonic() + timeout_s
        with self._lock:
            res = self._reservations.get(request_id)
            if res is None:
                raise KeyError(f"{request_id}: not expected (or already released)")
            while res.state not in (State.COMPLETE, State.FAILED):
                now_s = time.monotonic()
                if now_s >= res.deadline_s:
                    self._fail(
                        res,
                        TransferTimeout(
                            f"{request_id}: lease of {res.meta.lease_s:g} s expired with {res.progress()}"
                            + ("" if res.state is State.STREAMING else " (the sender never began)")
                        ),
                    )
                    break
                if now_s >= wait_deadline_s:
                    raise TransferTimeout(
                        f"{request_id}: wait timed out after {timeout_s:g} s with {res.progress()} "
                        f"(lease has {res.deadline_s - now_s:.3g} s left; the reservation stays)"
                    )
                self._changed.wait(min(res.deadline_s, wait_deadline_s) - now_s)
            if res.error is not None:
                raise res.error
            assert res.extras is not None
            layers = [] if res.on_layer is not None else [layer for layer in res.layers if layer is not None]
            return ReceivedKV(
                meta=res.meta,
                extras=res.extras,
                layers=layers,
                num_wire_bytes=res.meta.total_wire_bytes,
                elapsed_s=res.completed_at_s - res.expected_at_s,
            )

    def release(self, request_id: str) -> None:
        with self._lock:
            res = self._reservations.get(request_id)
            if res is None:
                return
            if res.state is not State.COMPLETE and res.error is None:
                # what data arriving meanwhile is told: as if it came just after (no reservation)
                res.error = ProtocolError(f"{request_id}: no reservation on this receiver (being released)")
                res.state = State.FAILED  # no new callbacks start
            while res.num_callbacks_running:
                self._changed.wait()
            del self._reservations[request_id]
            self._changed.notify_all()

    def pending_request_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._reservations)

    # ---- transport side ----

    def claim(self, request_id: str, secret: bytes) -> float:
        """Admit the sender presenting `secret` as the one sender of `request_id`, before taking any of its
        data. Returns the lease's end (`time.monotonic()` seconds), after which the transport may cut the
        sender off.

        Raises:
            HandoffRefused: no live reservation, no or a wrong secret, or the handoff already has its
                sender (a replay, whatever its secret). Nothing is recorded: the reservation, if any, goes
                on waiting for its real sender.
        """
        with self._lock:
            res = self._reservations.get(request_id)
            if res is None:
                raise HandoffRefused(
                    f"{request_id}: no reservation on this receiver (never expected, or released)"
                )
            # Constant-time comparison, and before anything else about the reservation is revealed.
            if not secret or not hmac.compare_digest(secret, res.meta.secret):
                raise HandoffRefused(f"{request_id}: sender refused: missing or wrong handoff secret")
            if res.state is not State.EXPECTING:
                raise HandoffRefused(
                    f"{request_id}: sender refused: the handoff already has its sender ({res.state.value})"
                )
            if time.monotonic() >= res.deadline_s:
                raise HandoffRefused(
                    f"{request_id}: sender refused: the lease of {res.meta.lease_s:g} s is over"
                )
            res.state = State.CLAIMED
            return res.deadline_s

    def on_begin(self, handoff: HandoffMeta) -> None:
        """The sender that `claim`ed the request opened the handoff; ProtocolError unless it matches the
        reservation (its `secret` is not compared again: `claim` did)."""
        with self._lock:
            res = self._reservations.get(handoff.request_id)
            if res is None or res.state is State.EXPECTING:  # the transport skipped claim(): record nothing
                raise HandoffRefused(f"{handoff.request_id}: begin from a sender that was not admitted")
            res = self._live(handoff.request_id)
            if res.state is not State.CLAIMED:
                self._raise(res, ProtocolError(f"{handoff.request_id}: begin received twice"))
            if handoff != res.meta:
                self._raise(
                    res,
                    ProtocolError(
                        f"{handoff.request_id}: sender's handoff {handoff} != reservation {res.meta}"
                    ),
                )
            res.state = State.STREAMING

    def on_layer(self, header: LayerHeader, payload: torch.Tensor) -> None:
        """A whole layer arrived (`payload`: 1-D uint8). Verifies it, then keeps it or calls `on_layer`; or,
        for a callback registered with `on_layer_checksums` and a float wire on the host, calls it with the
        layer unverified (`verified` False) and verifies the CRC it returns (see the module docstring).

        The checksum and decoding run outside the table's lock; `on_layer` runs on the calling thread.
        With `copy_kept_layers` and no `on_layer`, the payload is copied first and the copy is verified: the
        bytes kept are the bytes checked (nothing the sender writes later can change them); on the host the
        copy is chunked and each chunk checksummed right after it lands (`wire.copy_with_checksum`).
        """
        with self._lock:
            res = self._live_for_layer(header)
            callback = res.on_layer
            # on_layer checksums while it copies: float wires on the host (an int8 wire is decoded first)
            checks_after = (
                res.on_layer_checksums and header.wire_dtype != "int8" and payload.device.type == "cpu"
            )
        got = None
        if callback is None and self.copy_kept_layers and payload.device.type == "cpu":
            kept = torch.empty_like(payload)  # the copy's bytes are checksummed as they land (in cache)
            got = copy_with_checksum(kept, payload)
            payload = kept
        elif callback is None and self.copy_kept_layers:
            payload = payload.clone()
        try:
            if checks_after:
                check_payload_length(header, payload)
            else:
                verify_layer(header, payload, got)
        except KVTransferError as e:
            with self._lock:
                self._raise(res, e)
        layer = decode_layer(header, payload, self.int8_passthrough)
        if checks_after:
            layer = layer._replace(verified=False)
        with self._lock:
            self._live(header.request_id, need_streaming=True)  # still wanted (not released, lease running)?
            if callback is None:
                res.layers[header.layer_idx] = layer
            else:
                res.num_callbacks_running += 1
        error: KVTransferError | None = None
        if callback is not None:
            try:
                got = callback(header.layer_idx, layer)
            except Exception as e:
                error = KVTransferError(f"{header.request_id}: on_layer({header.layer_idx}) raised {e!r}")
                error.__cause__ = e
            if checks_after and error is None:
                try:  # a callback that returned no CRC (None, or not an integer) gets it computed here
                    got = None if got is None else operator.index(got)
                except TypeError:
                    got = None
                try:
                    verify_layer(header, payload, got)
                except KVTransferError as e:
                    error = e
        with self._lock:
            if callback is not None:
                res.num_callbacks_running -= 1
                self._changed.notify_all()  # release() may be waiting for this callback
            if error is not None:
                self._raise(res, error)
            if res.state is State.STREAMING:  # not failed or released meanwhile
                res.arrived[header.layer_idx] = True
                res.num_layers_arrived += 1
                self._changed.notify_all()

    def on_layer_in_place(self, header: LayerHeader, stored_crc: int) -> None:
        """A layer the sender wrote into the reservation's blocks itself (`shm_transport.inplace`) is
        complete: `stored_crc` is the CRC-32C of what the blocks hold, computed by the transport after the
        header came. Counts the layer as arrived if it matches the header's; raises (and records)
        ChecksumMismatch otherwise, or what `on_layer` would for a header that does not fit."""
        with self._lock:
            res = self._live_for_layer(header)
            try:
                if stored_crc != header.checksum:
                    raise ChecksumMismatch(
                        f"{header.request_id}: checksum mismatch on layer {header.layer_idx} written in "
                        f"place (crc32c {stored_crc:#010x} != sender's {header.checksum:#010x})"
                    )
            except KVTransferError as e:
                self._raise(res, e)
            res.arrived[header.layer_idx] = True
            res.num_layers_arrived += 1
            self._changed.notify_all()

    def on_finish(self, request_id: str, extras: HandoffExtras) -> None:
        """The sender closed the handoff (extras already checksum-verified by the transport)."""
        with self._lock:
            res = self._live(request_id, need_streaming=True)
            if res.num_layers_arrived != res.meta.num_layers:
                missing = [i for i, ok in enumerate(res.arrived) if not ok]
                self._raise(
                    res, ProtocolError(f"{request_id}: finish with {res.progress()}; missing {missing}")
                )
            res.extras = extras
            res.state = State.COMPLETE
            res.completed_at_s = time.monotonic()
            self._changed.notify_all()

    def on_finish_record(self, request_id: str, record: dict) -> None:
        """`on_finish` with the extras as `wire.extras_to_dict` encoded them; corrupted or malformed extras
        are recorded (ChecksumMismatch / ProtocolError) and raised."""
        try:
            extras = extras_from_dict(request_id, record)
        except KVTransferError as e:
            self.on_error(request_id, e)
            raise
        self.on_finish(request_id, extras)

    def on_abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            res = self._live(request_id)
            self._fail(
                res, TransferAborted(f"{request_id}: aborted by the sender after {res.progress()}: {reason}")
            )

    def on_sender_lost(self, request_id: str, why: str) -> None:
        """The transport lost the sender before `finish`; a no-op for a finished or unknown request."""
        with self._lock:
            res = self._reservations.get(request_id)
            if res is None or res.state in (State.COMPLETE, State.FAILED):
                return
            if time.monotonic() >= res.deadline_s:
                error: KVTransferError = TransferTimeout(
                    f"{request_id}: lease of {res.meta.lease_s:g} s expired with {res.progress()} ({why})"
                )
            else:
                error = SenderLost(f"{request_id}: sender lost with {res.progress()}: {why}")
            self._fail(res, error)

    def check_header(self, header: LayerHeader) -> None:
        """Raises (and records) unless a layer with this header would be accepted now; lets a transport
        vet a header before allocating its `num_bytes`."""
        with self._lock:
            res = self._live(header.request_id, need_streaming=True)
            try:
                check_header(res.meta, header)
            except KVTransferError as e:
                self._raise(res, e)

    def on_error(self, request_id: str, error: KVTransferError) -> None:
        """Record an error the transport found (malformed data, corrupted extras); the first error wins."""
        with self._lock:
            res = self._reservations.get(request_id)
            if res is not None and res.state is not State.COMPLETE:
                self._fail(res, error)

    def failure(self, request_id: str) -> KVTransferError | None:
        """The recorded error of a failed reservation (None if none or unknown)."""
        with self._lock:
            res = self._reservations.get(request_id)
            return None if res is None else res.error

    # ---- helpers (lock held) ----

    def _live(self, request_id: str, need_streaming: bool = False) -> _Reservation:
        """The reservation data may still be applied to; raises (and records) the reason otherwise."""
        res = self._reservations.get(request_id)
        if res is None:
            raise ProtocolError(
                f"{request_id}: no reservation on this receiver (never expected, or released)"
            )
        if res.state is State.FAILED:
            assert res.error is not None
            raise res.error
        if res.state is State.COMPLETE:
            raise ProtocolError(f"{request_id}: data after the handoff completed")
        if time.monotonic() >= res.deadline_s:
            self._raise(
                res,
                TransferTimeout(
                    f"{request_id}: lease of {res.meta.lease_s:g} s expired with {res.progress()}"
                ),
            )
        if need_streaming and res.state is not State.STREAMING:
            self._raise(res, ProtocolError(f"{request_id}: data before begin"))
        return res

    def _live_for_layer(self, header: LayerHeader) -> _Reservation:
        """The streaming reservation `header`'s layer may still arrive into; raises (and records) a header
        that does not fit the handoff or a layer received twice."""
        res = self._live(header.request_id, need_streaming=True)
        try:
            check_header(res.meta, header)
            if res.arrived[header.layer_idx]:
                raise ProtocolError(f"{header.request_id}: layer {header.layer_idx} received twice")
        except KVTransferError as e:
            self._raise(res, e)
        return res

    def _fail(self, res: _Reservation, error: KVTransferError) -> None:
        if res.state is not State.FAILED:
            res.state = State.FAILED
            res.error = error
            self._changed.notify_all()

    def _raise(self, res: _Reservation, error: KVTransferError) -> None:
        self._fail(res, error)
        assert res.error is not None
        raise res.error


class ReservationReceiver(KVReceiver):
    """A `KVReceiver` whose bookkeeping is a `Reservations` (`self._reservations`, set by the subclass);
    a transport only feeds it the frames it receives."""

    _reservations: Reservations

    def expect(
        self,
        handoff: HandoffMeta,
        on_layer: LayerCallback | None = None,
        on_layer_checksums: bool = False,
        block_ids: Sequence[int] | None = None,
    ) -> HandoffMeta:
        return self._reservations.expect(handoff, on_layer, on_layer_checksums, block_ids)

    def wait(self, request_id: str, timeout_s: float) -> ReceivedKV:
        return self._reservations.wait(request_id, timeout_s)

    def release(self, request_id: str) -> None:
        self._reservations.release(request_id)

    def pending_request_ids(self) -> list[str]:
        return self._reservations.pending_request_ids()
