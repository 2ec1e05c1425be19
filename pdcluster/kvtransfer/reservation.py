"""One reservation's state on the receiver (`Reservations` holds the table and the protocol)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdcluster.kvtransfer.base import (
    HandoffExtras,
    HandoffMeta,
    KVTransferError,
    LayerCallback,
    ReceivedLayer,
)


class State(enum.Enum):
    EXPECTING = "expecting"
    CLAIMED = "claimed"
    STREAMING = "streaming"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass
class Reservation:
    """One handoff on the receiver: `expecting -> claimed -> streaming -> complete`, or `failed`."""

    meta: HandoffMeta
    on_layer: LayerCallback | None
    on_layer_checksums: bool
    expected_at_s: float
    state: State = State.EXPECTING
    layers: list[ReceivedLayer | None] = field(default_factory=list)
    arrived: list[bool] = field(default_factory=list)
    num_layers_arrived: int = 0
    extras: HandoffExtras | None = None
    error: KVTransferError | None = None
    completed_at_s: float = 0.0
    block_ids: list[int] | None = None
    num_callbacks_running: int = 0

    @property
    def deadline_s(self) -> float:
        return self.expected_at_s + self.meta.lease_s

    def progress(self) -> str:
        return f"{self.num_layers_arrived}/{self.meta.num_layers} layers arrived"
