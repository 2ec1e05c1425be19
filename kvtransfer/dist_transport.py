"""torch.distributed transport: point-to-point sends from a prefill rank to a decode rank of a process group.

The backend comes from configuration (`DistTransportConfig`: gloo on CPU, NCCL on CUDA, HCCL on Ascend NPU),
as does the device of the staging tensors; nothing here names a device. The actor layer creates the group
(`init_transport_group`) and gives each prefill actor a `DistKVSender(peer_rank=<decode rank>)` and each
decode actor a `DistKVReceiver(peer_ranks=<its prefill ranks>)`. One sender per (group, peer) pair: two
would interleave their frames.

Every message is three sends, in order, on the pair:

    frame   int64 [2] = [FRAME_MAGIC, header_num_bytes]   (fixed size: the receiver always posts it first)
    header  uint8 [header_num_bytes]: msgpack {"kind": "begin" | "layer" | "finish" | "abort" | "bye", ...}
    payload uint8 [header["header"]["num_bytes"]]         (layer messages only: `kvtransfer.wire` layout)

`begin` carries the `HandoffMeta` (its `secret` included), `layer` a `LayerHeader` (CRC-32 of the payload),
`finish` the extras (with their CRC-32), `abort` the reason, `bye` ends the receiver's loop for that peer
(`DistKVSender.close`) and fails the peer's unfinished handoffs with SenderLost.

Authentication. The receiver admits a `begin` only with the secret decode's `expect` created, for a
handoff that has no sender yet (`Reservations.claim`); a begin without it, with a wrong one, or a second
begin (a replay) is dropped and the reservation is left alone. Layers, finish and abort are taken only from
the peer rank whose begin was admitted for that request; from any other rank they are dropped unrecorded.
The secret travels in clear inside the group (gloo/NCCL/HCCL neither authenticate nor encrypt), but it is
used up by the begin that carries it, so seeing it later gains nothing.

Rendezvous (`init_transport_group`, `tcp://host:port`): rank 0's TCPStore listens on `host` only (a
socket bound to that address, not torch's default of every interface), so a loopback topology's store
and, with gloo, its pairs (`GLOO_SOCKET_IFNAME` set to the loopback interface) are not reachable from
other machines. What stays open: any process on the host (or, for a routable `host`, on the network) can
connect to the store while the group exists and read or write its keys, and the backends' own
connections are unauthenticated. A process that joins or disturbs the rendezvous can break the group
(every handoff then fails, visibly) and may receive KV a prefill rank sends to the rank it impersonates;
it still cannot forge a handoff decode admits. Where that matters, use the grpc transport with TLS.

Threads: the sender's worker thread encodes (INT8, CRC-32) and sends, fed by a queue, so `send_layer`
returns at once. The receiver runs one thread per peer rank, blocked in `recv`, which verifies each layer and
runs decode's `on_layer`. There is no return path: a request decode refuses (checksum, no reservation) is
dropped on the receiver and the sender does not learn of it; the decode actor reports it (decode is the one
that decides). If the peer process dies, gloo's `recv` fails and the peer's handoffs fail with SenderLost.

Limits: a blocked `recv` cannot be interrupted (gloo closes the pair on a wait timeout), so
`DistKVReceiver.close` returns once each peer said `bye`, or after `join_timeout_s` leaving its daemon
thread; and an idle pair is closed by the backend after the group's timeout (`init_transport_group`'s
`timeout_s`, default one day). Checksums are computed on host bytes: with NCCL/HCCL that is one
device-to-host copy per layer on each side.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import msgpack
import torch
import torch.distributed as dist

from kvtransfer.base import (
    FailureLog,
    HandoffExtras,
    HandoffMeta,
    HandoffRefused,
    KVSender,
    KVTransferError,
    ProtocolError,
    TransferTimeout,
)
from kvtransfer.reservations import ReservationReceiver, Reservations
from kvtransfer.wire import (
    FaultHook,
    LayerHeader,
    apply_fault_hook,
    check_layer,
    encode_layer,
    extras_from_dict,
    extras_to_dict,
    meta_from_dict,
    meta_to_dict,
)

logger = logging.getLogger(__name__)

FRAME_MAGIC = 0x4B5658_0001  # "KVX" + wire version 1: a desynchronized stream is caught at the next frame
DEFAULT_GROUP_TIMEOUT_S = 24 * 3600.0
# Configuration tables, not transport logic: the topology names a device, this maps it to its backend.
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class DistTransportConfig:
    """backend: torch.distributed backend of the transfer group ("gloo", "nccl", "hccl").
    device: where staging tensors live ("cpu", "cuda:0", "npu:3"); the backend must be able to send from it.
    """

    backend: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.backend:
            raise ValueError("backend: must name a torch.distributed backend")
        device_type = self.device.split(":")[0]
        if device_type not in BACKEND_FOR_DEVICE:
            raise ValueError(
                f"device: one of {sorted(BACKEND_FOR_DEVICE)} (with an optional :index), got {self.device!r}"
            )

    @classmethod
    def for_device(cls, device: str) -> DistTransportConfig:
        """The default backend for a topology's `device` (cpu -> gloo, cuda -> nccl, npu -> hccl)."""
        device_type = device.split(":")[0]
        if device_type not in BACKEND_FOR_DEVICE:
            raise ValueError(f"device: must be one of {sorted(BACKEND_FOR_DEVICE)}, got {device!r}")
        return cls(backend=BACKEND_FOR_DEVICE[device_type], device=device)


def _loopback_interface() -> str | None:
    """The loopback interface's name (`lo` on Linux, `lo0` on BSD/macOS), or None if neither exists."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def rendezvous_store(host: str, port: int, *, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's TCPStore: rank 0 serves it on a socket bound to `host:port` only (torch's own binds every
    interface whatever the host), the others connect to it. OSError if rank 0 cannot bind there."""
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    try:
        store = dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.fileno()
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now
    return store


def init_transport_group(
    config: DistTransportConfig,
    *,
    rank: int,
    world_size: int,
    init_method: str,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> None:
    """`torch.distributed.init_process_group` with the configured backend (torch_npu imported lazily for
    NPU). `timeout_s` bounds how long a pair may sit idle (see the module docstring).

    `init_method` `tcp://host:port`: the rendezvous store listens on `host` only (`rendezvous_store`), and
    with gloo on a loopback `host` the pairs bind the loopback interface too (unless `GLOO_SOCKET_IFNAME`
    is set already). Other init methods (`env://`, `file://`) go to torch unchanged.
    """
    if config.device.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the "npu" device and the HCCL backend)
    timeout = timedelta(seconds=timeout_s)
    url = urlparse(init_method)
    if url.scheme != "tcp":
        dist.init_process_group(
            config.backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        return
    if url.hostname is None or url.port is None:
        raise ValueError(f"init_method: expected tcp://host:port, got {init_method!r}")
    if config.backend == "gloo" and _is_loopback(url.hostname) and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = _loopback_interface()
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    store = rendezvous_store(url.hostname, url.port, rank=rank, world_size=world_size, timeout_s=timeout_s)
    dist.init_process_group(config.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _send_message(
    record: dict[str, Any], payload: torch.Tensor | None, peer_rank: int, group: Any, device: torch.device
) -> None:
    header = msgpack.packb(record, use_bin_type=True)
    header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    frame = torch.tensor([FRAME_MAGIC, header_t.numel()], dtype=torch.int64, device=device)
    works = [dist.isend(frame, dst=peer_rank, group=group), dist.isend(header_t, dst=peer_rank, group=group)]
    if payload is not None:
        works.append(dist.isend(payload.to(device), dst=peer_rank, group=group))
    for work in works:
        work.wait()


def _recv_message(
    peer_rank: int, group: Any, device: torch.device
) -> tuple[dict[str, Any], torch.Tensor | None]:
    frame = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(frame, src=peer_rank, group=group)
    magic, header_num_bytes = frame.tolist()
    if magic != FRAME_MAGIC:
        raise ProtocolError(f"rank {peer_rank}: bad frame magic {magic:#x}; the stream is out of sync")
    header_t = torch.empty(header_num_bytes, dtype=torch.uint8, device=device)
    dist.recv(header_t, src=peer_rank, group=group)
    record = msgpack.unpackb(header_t.cpu().numpy().tobytes(), raw=False)
    payload = None
    if record["kind"] == "layer":
        payload = torch.empty(record["header"]["num_bytes"], dtype=torch.uint8, device=device)
        dist.recv(payload, src=peer_rank, group=group)
    return record, payload


# ---- sender (prefill side) ----


@dataclass
class _Request:
    meta: HandoffMeta
    begun_at_s: float
    closed: bool = False  # finish() or abort() called
    abort_reason: str | None = None
    stalled: bool = False  # the fault hook stopped it
    error: KVTransferError | None = None
    reported: bool = False  # its error went to the sender's FailureLog


@dataclass
class _Progress:
    num_enqueued: int = 0
    num_processed: int = 0
    requests: dict[str, _Request] = field(default_factory=dict)


class DistKVSender(KVSender):
    """Sends handoffs to the decode rank `peer_rank` of `group` (None: the default group).

    fault_hook: test-only fault injection (`kvtransfer.wire.FaultHook`); it sees every request's layers.
    """

    def __init__(
        self,
        peer_rank: int,
        config: DistTransportConfig,
        *,
        group: Any = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.peer_rank = peer_rank
        self.config = config
        self._device = torch.device(config.device)
        self._group = group
        self._fault_hook = fault_hook
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._progress = _Progress()
        self._failures = FailureLog()  # failed handoffs' errors until flush() reports them
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"kv-sender-to-rank{peer_rank}", daemon=True)
        self._worker.start()

    def begin(self, handoff: HandoffMeta) -> None:
        if not handoff.secret:
            raise ValueError(
                f"{handoff.request_id}: the handoff has no secret; begin with what expect returned"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("DistKVSender is closed")
            if handoff.request_id in self._progress.requests:
                raise ValueError(f"{handoff.request_id}: handoff already begun")
            self._progress.requests[handoff.request_id] = _Request(meta=handoff, begun_at_s=time.monotonic())
        self._enqueue(("begin", handoff.request_id))

    def send_layer(self, request_id: str, layer_idx: int, latent_kv: torch.Tensor) -> None:
        req = self._open_request(request_id)
        check_layer(req.meta, layer_idx, latent_kv)
        if req.error is None:
            self._enqueue(("layer", request_id, layer_idx, latent_kv.detach().clone()))

    def finish(self, request_id: str, extras: HandoffExtras) -> None:
        self._open_request(request_id).closed = True
        self._enqueue(("finish", request_id, extras))

    def abort(self, request_id: str, reason: str) -> None:
        req = self._open_request(request_id)
        req.closed = True
        req.abort_reason = reason  # layers still queued are dropped
        self._enqueue(("abort", request_id, reason))

    def flush(self, timeout_s: float) -> dict[str, KVTransferError]:
        deadline_s = time.monotonic() + timeout_s
        with self._lock:
            target = self._progress.num_enqueued
            while self._progress.num_processed < target:
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise TransferTimeout(
                        f"flush: {target - self._progress.num_processed} messages to rank {self.peer_rank} "
                        f"still queued after {timeout_s:g} s"
                    )
                self._changed.wait(remaining_s)
            return self._failures.pop_all()

    def pending_request_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._progress.requests)

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Sends what is queued, then `bye` (decode fails this sender's unfinished handoffs), and stops."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._enqueue(("bye", None))
        self._worker.join(join_timeout_s)
        with self._lock:
            self._progress.requests.clear()

    def _enqueue(self, item: tuple) -> None:
        with self._lock:
            self._progress.num_enqueued += 1
        self._queue.put(item)

    def _open_request(self, request_id: str) -> _Request:
        with self._lock:
            req = self._progress.requests.get(request_id)
        if req is None or req.closed:
            raise ValueError(f"{request_id}: no open handoff (never begun, or already finished/aborted)")
        return req

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            kind, request_id = item[0], item[1]
            with self._lock:
                req = None if request_id is None else self._progress.requests.get(request_id)
            try:
                if kind == "bye":
                    self._send({"kind": "bye"})
                elif req is not None:
                    self._process(req, item)
            except Exception as e:  # the pair failed: this request is lost; later ones will try again
                logger.warning("kv send to rank %d failed: %r", self.peer_rank, e)
                if req is not None:
                    with self._lock:
                        req.error = req.error or KVTransferError(
                            f"{request_id}: send to rank {self.peer_rank} failed: {e!r}"
                        )
            finally:
                with self._lock:
                    self._progress.num_processed += 1
                    if req is not None:
                        if req.error is not None and not req.reported:  # only the error waits for flush()
                            self._failures.add(request_id, req.error)
                            req.reported = True
                        if kind in ("finish", "abort") and self._progress.requests.get(request_id) is req:
                            del self._progress.requests[request_id]  # delivered or failed: forget it
                    self._changed.notify_all()
            if kind == "bye":
                return

    def _process(self, req: _Request, item: tuple) -> None:
        kind, meta = item[0], req.meta
        if req.error is not None or req.stalled:
            return
        if kind == "layer" and req.abort_reason is not None:
            return
        if kind != "abort" and time.monotonic() >= req.begun_at_s + meta.lease_s:
            req.error = TransferTimeout(
                f"{meta.request_id}: sender's lease of {meta.lease_s:g} s expired before {kind}"
            )
            self._send({"kind": "abort", "request_id": meta.request_id, "reason": str(req.error)})
            return
        if kind == "begin":
            self._send({"kind": "begin", "meta": meta_to_dict(meta)})
        elif kind == "layer":
            layer, keep_sending = apply_fault_hook(self._fault_hook, encode_layer(meta, item[2], item[3]))
            if not keep_sending:
                req.stalled = True
                return
            self._send({"kind": "layer", "header": layer.header.to_dict()}, layer.payload)
        elif kind == "finish":
            self._send({"kind": "finish", "request_id": meta.request_id, "extras": extras_to_dict(item[2])})
        elif kind == "abort":
            self._send({"kind": "abort", "request_id": meta.request_id, "reason": item[2]})

    def _send(self, record: dict[str, Any], payload: torch.Tensor | None = None) -> None:
        _send_message(record, payload, self.peer_rank, self._group, self._device)


# ---- receiver (decode side) ----


class DistKVReceiver(ReservationReceiver):
    """Receives handoffs from the prefill ranks `peer_ranks` of `group` (None: the default group), one
    receive thread per peer. `int8_passthrough` as in `kvtransfer.reservations.Reservations`.

    Received tensors live on `config.device` (views of the received payload on a float wire).
    """

    def __init__(
        self,
        peer_ranks: list[int],
        config: DistTransportConfig,
        *,
        group: Any = None,
        int8_passthrough: bool = False,
    ) -> None:
        self.peer_ranks = list(peer_ranks)
        self.config = config
        self._device = torch.device(config.device)
        self._group = group
        self._reservations = Reservations(int8_passthrough)
        self._threads = [
            threading.Thread(target=self._run, args=(peer,), name=f"kv-receiver-from-rank{peer}", daemon=True)
            for peer in self.peer_ranks
        ]
        for thread in self._threads:
            thread.start()

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Waits up to `join_timeout_s` for every peer's `bye` (see the module docstring). A peer that said
        `bye` is not listened to again: a restarted sender on that rank needs a new receiver."""
        deadline_s = time.monotonic() + join_timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline_s - time.monotonic()))

    def _run(self, peer_rank: int) -> None:
        in_flight: set[str] = set()  # admitted for this peer (its begin), not yet finished or aborted
        while True:
            try:
                record, payload = _recv_message(peer_rank, self._group, self._device)
            except Exception as e:  # peer died, pair closed, or the stream is out of sync
                logger.warning("kv receive from rank %d stopped: %r", peer_rank, e)
                for request_id in in_flight:
                    self._reservations.on_sender_lost(
                        request_id, f"receiving from rank {peer_rank} failed: {e}"
                    )
                return
            if record["kind"] == "bye":
                for request_id in in_flight:
                    self._reservations.on_sender_lost(request_id, f"rank {peer_rank} closed before finish")
                return
            try:
                self._dispatch(peer_rank, record, payload, in_flight)
            except HandoffRefused as e:  # not this peer's handoff: dropped, nothing recorded
                logger.warning("kv transfer from rank %d refused: %s", peer_rank, e)
            except KVTransferError as e:  # recorded on the reservation (if any); the rest of it is dropped
                logger.info("kv transfer from rank %d: %s", peer_rank, e)
            except (KeyError, TypeError, ValueError) as e:  # a malformed record: dropped, nothing recorded
                logger.warning(
                    "kv transfer from rank %d: malformed %r record: %r", peer_rank, record.get("kind"), e
                )

    def _dispatch(
        self, peer_rank: int, record: dict[str, Any], payload: torch.Tensor | None, in_flight: set[str]
    ) -> None:
        """Apply one record from `peer_rank`. `in_flight`: the requests this peer was admitted to.

        Raises:
            HandoffRefused: a begin that `Reservations.claim` refused, or data for a request this peer was
                not admitted to (nothing recorded); other `KVTransferError`s as `Reservations` records them.
        """
        kind = record["kind"]
        if kind == "begin":
            meta = meta_from_dict(record["meta"])
            self._reservations.claim(meta.request_id, meta.secret)
            in_flight.add(meta.request_id)  # from here on, this peer's data for it is the handoff's
            self._reservations.on_begin(meta)
            return
        if kind not in ("layer", "finish", "abort"):
            raise ProtocolError(f"unknown message kind {kind!r}")
        request_id = record["header"]["request_id"] if kind == "layer" else record["request_id"]
        if request_id not in in_flight:
            raise HandoffRefused(f"{request_id}: {kind} from rank {peer_rank}, which was not admitted to it")
        if kind == "layer":
            assert payload is not None
            self._reservations.on_layer(LayerHeader.from_dict(record["header"]), payload)
        elif kind == "finish":
            in_flight.discard(request_id)
            try:
                extras = extras_from_dict(request_id, record["extras"])
            except KVTransferError as e:
                self._reservations.on_error(request_id, e)
                raise
            self._reservations.on_finish(request_id, extras)
        else:
            in_flight.discard(request_id)
            self._reservations.on_abort(request_id, record["reason"])
