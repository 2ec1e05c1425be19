"""The KV connector: one request's latent KV goes from a prefill to a decode instance, layer by layer.

Decode (`KVReceiver`): `expect` after reserving blocks, before prefill starts; `wait` until every layer and
the extras arrived verified; `release` always. Prefill (`KVSender`): `begin`; `send_layer` per layer;
`finish` or `abort`; `flush` to learn which deliveries failed; `close` at shutdown. Only the first sender
presenting the handoff's secret is admitted; any `KVTransferError` fails the whole handoff.
"""

from __future__ import annotations

import abc
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from pdcluster.models.dtypes import DTYPES, MODEL_DTYPE_NAMES

if TYPE_CHECKING:
    from pdcluster.engine.outputs import TokenLogprobs

# Element dtypes a handoff may name (model dtype / wire dtype), by the name used on the wire: `DTYPES`.
FLOAT_DTYPE_NAMES = MODEL_DTYPE_NAMES
INT8_SCALE_DTYPE = torch.float32  # one scale per token on an int8 wire (kernels.kv_quant)
HANDOFF_SECRET_NUM_BYTES = 32


def resolve_wire_dtype(wire_dtype: str, model_dtype: str, kv_cache_dtype: str) -> str:
    """The `HandoffMeta.wire_dtype` for `kv_transfer.wire_dtype` (`"auto"`/`"int8"`); ValueError otherwise."""
    if wire_dtype == "int8":
        return "int8"
    if wire_dtype != "auto":
        raise ValueError(f"wire_dtype: must be 'auto' or 'int8', got {wire_dtype!r}")
    return "int8" if kv_cache_dtype == "int8" else model_dtype


def new_handoff_secret() -> bytes:
    return secrets.token_bytes(HANDOFF_SECRET_NUM_BYTES)


@dataclass(frozen=True)
class HandoffMeta:
    """What both sides agree on before any byte moves: `dtype` (model), `wire_dtype` (`dtype` or per-token
    `"int8"`), `lease_s` (seconds from `expect()`/`begin()` for the whole handoff)."""

    request_id: str
    num_layers: int
    num_tokens: int
    kv_dim: int
    dtype: str = "bfloat16"
    wire_dtype: str = "bfloat16"
    lease_s: float = 30.0
    secret: bytes = field(default=b"", repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id: must be a non-empty string")
        for name in ("num_layers", "num_tokens", "kv_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.dtype not in FLOAT_DTYPE_NAMES:
            raise ValueError(f"dtype: must be one of {FLOAT_DTYPE_NAMES}, got {self.dtype!r}")
        if self.wire_dtype not in (self.dtype, "int8"):
            raise ValueError(
                f"wire_dtype: must be {self.dtype!r} (the model dtype) or 'int8', got {self.wire_dtype!r}"
            )
        if not self.lease_s > 0:
            raise ValueError(f"lease_s: must be positive, got {self.lease_s}")
        if not isinstance(self.secret, bytes):
            raise ValueError(f"secret: must be bytes, got {type(self.secret).__name__}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_int8_wire(self) -> bool:
        return self.wire_dtype == "int8"

    @property
    def layer_wire_bytes(self) -> int:
        """Payload bytes of one layer: values, plus one float32 scale per token on an int8 wire."""
        num_bytes = self.num_tokens * self.kv_dim * DTYPES[self.wire_dtype].itemsize
        if self.is_int8_wire:
            num_bytes += self.num_tokens * INT8_SCALE_DTYPE.itemsize
        return num_bytes

    @property
    def total_wire_bytes(self) -> int:
        return self.layer_wire_bytes * self.num_layers


@dataclass
class HandoffExtras:
    """What decode needs besides the KV; draft_probs: [num_drafts, vocab_size] float32 or None (greedy)."""

    first_token_id: int
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    first_token_logprobs: TokenLogprobs | None = None


class ReceivedLayer(NamedTuple):
    """One layer: latent [num_tokens, kv_dim] model dtype or int8; scale [num_tokens] float32 with int8."""

    latent: torch.Tensor
    scale: torch.Tensor | None = None
    verified: bool = True


# on_layer(layer_idx, layer): runs on the transport's receive thread (see `KVReceiver.expect`).
LayerCallback = Callable[[int, ReceivedLayer], int | None]


@dataclass
class ReceivedKV:
    """A complete, verified handoff; `layers` is empty when `on_layer` consumed them."""

    meta: HandoffMeta
    extras: HandoffExtras
    layers: list[ReceivedLayer]
    num_wire_bytes: int
    elapsed_s: float


class KVTransferError(RuntimeError):
    """A handoff failed; the request must be released on decode and re-dispatched."""


class TransferTimeout(KVTransferError):
    """The lease (or the caller's wait) ran out; the message says how many layers arrived."""


class SenderLost(TransferTimeout):
    """The transport saw the sender go away before `finish`: raised at once, not at lease expiry."""


class ChecksumMismatch(KVTransferError):
    """A layer's (or the extras') bytes do not match the sender's checksum; the message names the layer."""


class TransferAborted(KVTransferError):
    """The sender called `abort(request_id, reason)`; the message carries the reason."""


class ProtocolError(KVTransferError):
    """The two sides disagree: no reservation, a mismatched handoff, a duplicate or out-of-range layer."""


class HandoffRefused(ProtocolError):
    """A sender was not admitted (no reservation, wrong secret, or a replay); the reservation is untouched."""


# Every `KVTransferError` class by name, for transports that send an error as its class name and message.
ERROR_CLASSES: dict[str, type[KVTransferError]] = {
    cls.__name__: cls
    for cls in (
        KVTransferError,
        TransferTimeout,
        SenderLost,
        ChecksumMismatch,
        TransferAborted,
        ProtocolError,
        HandoffRefused,
    )
}


class FailureLog:
    """Failed handoffs not yet reported by `flush` (request id -> error), at most `max_records`; unlocked."""

    def __init__(self, max_records: int = 1024) -> None:
        self.max_records = max_records
        self._errors: OrderedDict[str, KVTransferError] = OrderedDict()

    def add(self, request_id: str, error: KVTransferError) -> None:
        self._errors[request_id] = error
        self._errors.move_to_end(request_id)
        while len(self._errors) > self.max_records:
            self._errors.popitem(last=False)

    def pop_all(self) -> dict[str, KVTransferError]:
        errors, self._errors = dict(self._errors), OrderedDict()
        return errors

    def __len__(self) -> int:
        return len(self._errors)


class KVSender(abc.ABC):
    """Prefill side: methods are called from one thread; delivery runs in the background."""

    @abc.abstractmethod
    def begin(self, handoff: HandoffMeta) -> None:
        """Open the handoff; raises ValueError if `request_id` is open or `handoff.secret` is empty."""

    @abc.abstractmethod
    def send_layer(
        self, request_id: str, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        """Copy one layer's KV (latent_kv [num_tokens, kv_dim], scale [num_tokens] float32 with int8) and
        enqueue it. Raises ValueError for an unknown request, an out-of-range layer or a wrong shape/dtype.
        """

    @abc.abstractmethod
    def finish(self, request_id: str, extras: HandoffExtras) -> None: ...

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str) -> None:
        """Drop the layers not yet sent; decode's `wait` raises TransferAborted with `reason`."""

    @abc.abstractmethod
    def flush(self, timeout_s: float) -> dict[str, KVTransferError]:
        """`{request_id: error}` since the last flush, waiting up to `timeout_s` for closed requests.
        Raises TransferTimeout if a finished request is still in flight."""

    @abc.abstractmethod
    def pending_request_ids(self) -> list[str]:
        """Requests begun and not yet delivered or failed (a leak check for tests)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(abc.ABC):
    """Decode side: `expect`/`wait`/`release` from the actor's threads; data on the transport's threads."""

    @abc.abstractmethod
    def expect(
        self,
        handoff: HandoffMeta,
        on_layer: LayerCallback | None = None,
        on_layer_checksums: bool = False,
        block_ids: Sequence[int] | None = None,
    ) -> HandoffMeta:
        """Register a reservation, start its lease, return `handoff` with a fresh `secret`.
        Raises ValueError if `request_id` is reserved or `handoff` already carries a secret."""

    @abc.abstractmethod
    def wait(self, request_id: str, timeout_s: float) -> ReceivedKV:
        """Block until complete and verified, else raise a `KVTransferError`; KeyError if not expected."""

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget the reservation (no-op if unknown); after it, no `on_layer` runs."""

    @abc.abstractmethod
    def pending_request_ids(self) -> list[str]: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop receiving; the caller releases pending reservations."""
