from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from pdcluster.kvtransfer.base import HandoffRefused, KVTransferError, ProtocolError
from pdcluster.kvtransfer.dist_transport.framing import recv_message
from pdcluster.kvtransfer.dist_transport.group import DistTransportConfig
from pdcluster.kvtransfer.reservations import ReservationReceiver, Reservations
from pdcluster.kvtransfer.wire import LayerHeader, meta_from_dict

logger = logging.getLogger(__name__)


class DistKVReceiver(ReservationReceiver):
    """Receives handoffs from `peer_ranks` of `group`, one receive thread per peer.

    Tensors live on `config.device`; `int8_passthrough` as in `Reservations`.
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
        """Waits up to `join_timeout_s` for each peer's `bye`; a peer that said `bye` is not heard again."""
        deadline_s = time.monotonic() + join_timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline_s - time.monotonic()))

    def _run(self, peer_rank: int) -> None:
        in_flight: set[str] = set()  # admitted for this peer (its begin), not yet finished or aborted
        while True:
            try:
                record, payload = recv_message(peer_rank, self._group, self._device)
            except Exception as e:
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
            except HandoffRefused as e:
                logger.warning("kv transfer from rank %d refused: %s", peer_rank, e)
            except KVTransferError as e:
                logger.info("kv transfer from rank %d: %s", peer_rank, e)
            except (KeyError, TypeError, ValueError) as e:
                logger.warning(
                    "kv transfer from rank %d: malformed %r record: %r", peer_rank, record.get("kind"), e
                )

    def _dispatch(
        self, peer_rank: int, record: dict[str, Any], payload: torch.Tensor | None, in_flight: set[str]
    ) -> None:
        """Apply one record; HandoffRefused for data from a peer not admitted to its request."""
        kind = record["kind"]
        if kind == "begin":
            meta = meta_from_dict(record["meta"])
            self._reservations.claim(meta.request_id, meta.secret)
            in_flight.add(meta.request_id)
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
            self._reservations.on_finish_record(request_id, record["extras"])
        else:
            in_flight.discard(request_id)
            self._reservations.on_abort(request_id, record["reason"])
