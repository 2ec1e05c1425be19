from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcluster.kvtransfer.base import (
    FailureLog,
    HandoffExtras,
    HandoffMeta,
    KVSender,
    KVTransferError,
    TransferTimeout,
)
from pdcluster.kvtransfer.dist_transport.framing import send_message
from pdcluster.kvtransfer.dist_transport.group import DistTransportConfig
from pdcluster.kvtransfer.sending import SenderHandoff, check_begin, close_handoff, open_handoff
from pdcluster.kvtransfer.wire import (
    FaultHook,
    apply_fault_hook,
    copy_layer,
    encode_layer,
    extras_to_dict,
    meta_to_dict,
)

logger = logging.getLogger(__name__)


@dataclass
class _Request(SenderHandoff):
    error: KVTransferError | None = None
    reported: bool = False


@dataclass
class _Progress:
    num_enqueued: int = 0
    num_processed: int = 0
    requests: dict[str, _Request] = field(default_factory=dict)


class DistKVSender(KVSender):
    """Sends handoffs to decode rank `peer_rank` of `group` from one worker thread.

    fault_hook: test-only fault injection (`kvtransfer.wire.FaultHook`).
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
        self._failures = FailureLog()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"kv-sender-to-rank{peer_rank}", daemon=True)
        self._worker.start()

    def begin(self, handoff: HandoffMeta) -> None:
        with self._lock:
            check_begin(handoff, "DistKVSender", self._closed, self._progress.requests)
            self._progress.requests[handoff.request_id] = _Request(meta=handoff, begun_at_s=time.monotonic())
        self._enqueue(("begin", handoff.request_id))

    def send_layer(
        self, request_id: str, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        req = self._open_request(request_id)
        latent_copy, scale_copy = copy_layer(req.meta, layer_idx, latent_kv, scale)
        if req.error is None:
            self._enqueue(("layer", request_id, layer_idx, latent_copy, scale_copy))

    def finish(self, request_id: str, extras: HandoffExtras) -> None:
        with self._lock:
            close_handoff(self._progress.requests, request_id)
        self._enqueue(("finish", request_id, extras))

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            close_handoff(self._progress.requests, request_id, reason)
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
        """Send what is queued, then `bye` (decode fails unfinished handoffs with SenderLost)."""
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
            return open_handoff(self._progress.requests, request_id)

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
            except Exception as e:
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
                        if req.error is not None and not req.reported:
                            self._failures.add(request_id, req.error)
                            req.reported = True
                        if kind in ("finish", "abort") and self._progress.requests.get(request_id) is req:
                            del self._progress.requests[request_id]
                    self._changed.notify_all()
            if kind == "bye":
                return

    def _process(self, req: _Request, item: tuple) -> None:
        kind, meta = item[0], req.meta
        if req.error is not None or req.stalled:
            return
        if kind == "layer" and req.abort_reason is not None:
            return
        if kind != "abort" and time.monotonic() >= req.deadline_s:
            req.error = TransferTimeout(
                f"{meta.request_id}: sender's lease of {meta.lease_s:g} s expired before {kind}"
            )
            self._send({"kind": "abort", "request_id": meta.request_id, "reason": str(req.error)})
            return
        if kind == "begin":
            self._send({"kind": "begin", "meta": meta_to_dict(meta)})
        elif kind == "layer":
            layer, keep_sending = apply_fault_hook(
                self._fault_hook, encode_layer(meta, item[2], item[3], item[4])
            )
            if not keep_sending:
                req.stalled = True
                return
            self._send({"kind": "layer", "header": layer.header.to_dict()}, layer.payload)
        elif kind == "finish":
            self._send({"kind": "finish", "request_id": meta.request_id, "extras": extras_to_dict(item[2])})
        elif kind == "abort":
            self._send({"kind": "abort", "request_id": meta.request_id, "reason": item[2]})

    def _send(self, record: dict[str, Any], payload: torch.Tensor | None = None) -> None:
        send_message(record, payload, self.peer_rank, self._group, self._device)
