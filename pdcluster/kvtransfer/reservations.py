"""Receiver-side bookkeeping shared by every transport: reservations, leases, per-layer completion.

A transport feeds `Reservations` through `claim`, `on_begin`, `on_layer`, `on_finish`, `on_abort` and
`on_sender_lost`; each raises the `KVTransferError` it recorded, so the transport can tell the sender.
A reservation moves expecting -> claimed -> streaming -> complete, or to failed before complete; only
`release` removes it. A layer reaches decode only after its header matched and its CRC-32C verified,
except with `on_layer_checksums`, where `on_layer` copies first and returns the CRC to check.
"""

from __future__ import annotations

import dataclasses
import hmac
import operator
import threading
import time
from collections.abc import Sequence
from typing import Any

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
    SenderLost,
    TransferAborted,
    TransferTimeout,
    new_handoff_secret,
)
from pdcluster.kvtransfer.reservation import Reservation, State
from pdcluster.kvtransfer.wire import (
    LayerHeader,
    check_header,
    check_payload_length,
    copy_with_checksum,
    decode_layer,
    extras_from_dict,
    verify_layer,
)


class Reservations:
    """Thread-safe table of one receiver's reservations.

    int8_passthrough: hand int8 + scales through on an int8 wire instead of dequantizing.
    copy_kept_layers: copy a layer kept for `wait` out of the payload (for transports that reuse buffers).
    """

    def __init__(self, int8_passthrough: bool = False, copy_kept_layers: bool = False) -> None:
        self.int8_passthrough = int8_passthrough
        self.copy_kept_layers = copy_kept_layers
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._reservations: dict[str, Reservation] = {}

    def expect(
        self,
        handoff: HandoffMeta,
        on_layer: LayerCallback | None = None,
        on_layer_checksums: bool = False,
        block_ids: Sequence[int] | None = None,
    ) -> HandoffMeta:
        if handoff.secret:
            raise ValueError(
                f"{handoff.request_id}: the handoff already has a secret; the receiver creates it"
            )
        bound = dataclasses.replace(handoff, secret=new_handoff_secret())
        with self._lock:
            if handoff.request_id in self._reservations:
                raise ValueError(f"{handoff.request_id}: already reserved")
            self._reservations[handoff.request_id] = Reservation(
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
                res.error = ProtocolError(f"{request_id}: no reservation on this receiver (being released)")
                res.state = State.FAILED
            while res.num_callbacks_running:
                self._changed.wait()
            del self._reservations[request_id]
            self._changed.notify_all()

    def pending_request_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._reservations)

    def claim(self, request_id: str, secret: bytes) -> float:
        """Admit the first sender presenting `secret`; returns the lease's end (`time.monotonic()` s).

        Raises HandoffRefused (nothing recorded): no live reservation, a wrong secret, or a replay.
        """
        with self._lock:
            res = self._reservations.get(request_id)
            if res is None:
                raise HandoffRefused(
                    f"{request_id}: no reservation on this receiver (never expected, or released)"
                )
            # Constant-time, before anything else about the reservation is revealed.
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
        """The claiming sender opened the handoff; ProtocolError unless it matches the reservation."""
        with self._lock:
            res = self._reservations.get(handoff.request_id)
            if res is None or res.state is State.EXPECTING:
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
        """A whole layer arrived (`payload`: [num_bytes] uint8): verify it, then keep it or call `on_layer`.

        Checksum and decoding run outside the lock; `on_layer` runs on the calling thread.
        """
        with self._lock:
            res = self._live_for_layer(header)
            callback = res.on_layer
            checks_after = (
                res.on_layer_checksums and header.wire_dtype != "int8" and payload.device.type == "cpu"
            )
        got = None
        if callback is None and self.copy_kept_layers and payload.device.type == "cpu":
            kept = torch.empty_like(payload)
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
            self._live(header.request_id, need_streaming=True)
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
                try:
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
                self._changed.notify_all()
            if error is not None:
                self._raise(res, error)
            if res.state is State.STREAMING:
                res.arrived[header.layer_idx] = True
                res.num_layers_arrived += 1
                self._changed.notify_all()

    def on_layer_in_place(self, header: LayerHeader, stored_crc: int) -> None:
        """A layer the sender wrote into the reserved blocks itself is complete if `stored_crc` matches.

        Raises (and records) ChecksumMismatch, or what `on_layer` would for a header that does not fit.
        """
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
        """`on_finish` with `wire.extras_to_dict` extras; bad extras are recorded and raised."""
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
        """Raise (and record) unless a layer with this header would be accepted now."""
        with self._lock:
            res = self._live(header.request_id, need_streaming=True)
            try:
                check_header(res.meta, header)
            except KVTransferError as e:
                self._raise(res, e)

    def on_error(self, request_id: str, error: KVTransferError) -> None:
        """Record an error the transport found; the first error wins."""
        with self._lock:
            res = self._reservations.get(request_id)
            if res is not None and res.state is not State.COMPLETE:
                self._fail(res, error)

    def failure(self, request_id: str) -> KVTransferError | None:
        with self._lock:
            res = self._reservations.get(request_id)
            return None if res is None else res.error

    def _live(self, request_id: str, need_streaming: bool = False) -> Reservation:
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

    def _live_for_layer(self, header: LayerHeader) -> Reservation:
        res = self._live(header.request_id, need_streaming=True)
        try:
            check_header(res.meta, header)
            if res.arrived[header.layer_idx]:
                raise ProtocolError(f"{header.request_id}: layer {header.layer_idx} received twice")
        except KVTransferError as e:
            self._raise(res, e)
        return res

    def _fail(self, res: Reservation, error: KVTransferError) -> None:
        if res.state is not State.FAILED:
            res.state = State.FAILED
            res.error = error
            self._changed.notify_all()

    def _raise(self, res: Reservation, error: KVTransferError) -> None:
        self._fail(res, error)
        assert res.error is not None
        raise res.error


class ReservationReceiver(KVReceiver):
    """A `KVReceiver` whose bookkeeping is `self._reservations`, set by the subclass."""

    _reservations: Reservations

    def expect(self, handoff: HandoffMeta, *options: Any, **named: Any) -> HandoffMeta:
        """`KVReceiver.expect`, done by `Reservations.expect` (the same options)."""
        return self._reservations.expect(handoff, *options, **named)

    def wait(self, request_id: str, timeout_s: float) -> ReceivedKV:
        return self._reservations.wait(request_id, timeout_s)

    def release(self, request_id: str) -> None:
        self._reservations.release(request_id)

    def pending_request_ids(self) -> list[str]:
        return self._reservations.pending_request_ids()
