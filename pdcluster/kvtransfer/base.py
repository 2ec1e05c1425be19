"""The KV connector: one request's latent KV goes from a prefill to a decode instance, layer by layer.

Who calls what, and when (one request, `request_id`):

Decode instance (receiver side, `KVReceiver`), on the decode actor's thread:
    1. `expect(handoff, on_layer)` once the router picked this instance and decode reserved the request's
       KV blocks, and BEFORE the prefill side is told to start (data for an unknown request is refused).
       Starts the lease: the whole handoff must arrive within `handoff.lease_s` of this call. Returns the
       handoff bound to the reservation: the same `HandoffMeta` with a fresh `secret` (32 random bytes),
       which goes to the chosen prefill instance only (through the driver, over Ray).
    2. `wait(request_id, timeout_s)` blocks until every layer arrived with a verified checksum and the
       extras arrived, and returns a `ReceivedKV`; otherwise raises a `KVTransferError` subclass.
       `on_layer(layer_idx, ReceivedLayer)` (optional) runs on the transport's receive thread as each layer
       arrives and verifies, so decode can write it into its paged blocks at once (with
       `on_layer_checksums`, on a float layer before it verifies; `on_layer` returns the CRC it computed).
    3. `release(request_id)` in all cases (success, error, cancel): forgets the reservation. It returns only
       after an `on_layer` call in progress for the request has returned, and none runs after it, so decode
       may free the request's blocks right away. Later data for the request is refused.

Prefill instance (sender side, `KVSender`), on the prefill actor's thread:
    1. `begin(handoff)` when the request's prefill is scheduled, with the `HandoffMeta` decode's `expect`
       returned (the one carrying the secret).
    2. `send_layer(request_id, layer_idx, latent_kv, scale)` from the model runner's `on_layer_kv` hook right
       after each layer's KV is computed (MTP layer: `layer_idx = num_hidden_layers`). It copies the tensor,
       enqueues it and returns, so the next layer's forward overlaps the transfer. With chunked prefill the
       caller sends each layer once, at the last chunk, e.g. `kernels.paged_mla.gather_kv` of that layer
       (the hook runs after the chunk's KV was written): the cache's own bytes, so an int8 cache gives int8
       values with their `scale`, which an int8 wire carries as they are.
    3. `finish(request_id, extras)` once the first token (and MTP drafts) are sampled; or
       `abort(request_id, reason)` instead, which makes decode's `wait` raise `TransferAborted`.
    4. `flush(timeout_s)` to wait for delivery of finished/aborted requests and learn which failed;
       `close()` at shutdown (requests still open are cut off; decode sees `SenderLost`).
    A sender forgets a request (its queued layers included) by itself as soon as the request is closed
    (`finish`/`abort`) and its delivery ended, delivered or failed: only a failure's error stays, in a
    bounded `FailureLog`, until `flush` reports it. Nobody has to call `flush` for memory to be freed.

Authentication: the receiver accepts a handoff's data only from the one sender that presented the
handoff's secret first (`hmac.compare_digest`), checked before any of the sender's data is read into the
reservation; every other sender (no secret, a wrong one, a second sender with the right one: a replay) is
refused with `HandoffRefused` and the reservation is left untouched, so the real sender still delivers.
The secret binds a sender to one reservation; it does not encrypt anything (gRPC can add TLS).

A handoff is all-or-nothing: decode admits the request only when `wait` returns. On any error the request is
released on decode and re-dispatched to a prefill instance by the caller; nothing partial is ever used.

Errors (all `KVTransferError`): `TransferTimeout` (lease expired: sender stalled, slow or died unseen;
says how many layers arrived) and its subclass `SenderLost` (the transport saw the sender go away before
`finish`, raised without waiting for the lease), `ChecksumMismatch`
(names the layer), `TransferAborted` (sender's reason), `ProtocolError` (the two sides disagree: a handoff
that does not match the reservation, a duplicate or out-of-range layer, no reservation) and its subclass
`HandoffRefused` (a sender not admitted: seen by that sender only, never recorded on the reservation).
"""

from __future__ import annotations

import abc
import secrets
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from pdcluster.models.dtypes import DTYPES, MODEL_DTYPE_NAMES

if TYPE_CHECKING:
    from pdcluster.engine.outputs import TokenLogprobs

# Element dtypes a handoff may name (model dtype / wire dtype), by the name used on the wire: `DTYPES`.
FLOAT_DTYPE_NAMES = MODEL_DTYPE_NAMES
INT8_SCALE_DTYPE = torch.float32  # one scale per token on an int8 wire (kernels.kv_quant)
HANDOFF_SECRET_NUM_BYTES = 32  # 256 bits from `secrets.token_bytes`: not guessable within any lease


def resolve_wire_dtype(wire_dtype: str, model_dtype: str, kv_cache_dtype: str) -> str:
    """The `HandoffMeta.wire_dtype` for a topology's `kv_transfer.wire_dtype`.

    wire_dtype: `"auto"` (the dtype decode's KV cache stores: `"int8"` for an int8 cache, whose bytes then
        pass straight through, else `model_dtype`) or `"int8"`.
    model_dtype: the model dtype name (`"bfloat16"`, ...); kv_cache_dtype: decode's `"auto"` or `"int8"`.

    Raises:
        ValueError: an unknown `wire_dtype`.
    """
    if wire_dtype == "int8":
        return "int8"
    if wire_dtype != "auto":
        raise ValueError(f"wire_dtype: must be 'auto' or 'int8', got {wire_dtype!r}")
    return "int8" if kv_cache_dtype == "int8" else model_dtype


def new_handoff_secret() -> bytes:
    """A fresh per-handoff secret: `HANDOFF_SECRET_NUM_BYTES` bytes from the OS's CSPRNG."""
    return secrets.token_bytes(HANDOFF_SECRET_NUM_BYTES)


@dataclass(frozen=True)
class HandoffMeta:
    """What both sides agree on before any byte moves; the router builds it once and gives it to both.

    request_id: the request's id (unique among requests in flight on a sender/receiver pair).
    num_layers: layers whose KV is sent, main layers plus MTP layers: indices `0 .. num_layers - 1`, the MTP
        layer at `num_hidden_layers`.
    num_tokens: tokens of KV per layer (the prompt length).
    kv_dim: `kv_lora_rank + qk_rope_head_dim` (576 for DeepSeek-V3).
    dtype: model dtype name (`"bfloat16"`, `"float16"`, `"float32"`): the dtype of a float `latent_kv` given
        to `send_layer` (an int8 cache's layer comes as int8 + scales) and of the tensors the receiver hands
        out (unless it passes int8 through).
    wire_dtype: `dtype` (raw bytes) or `"int8"` (per-token INT8, `kernels.kv_quant`, about half the bytes).
    lease_s: seconds from `expect()` (receiver) / `begin()` (sender) within which the whole handoff must be
        complete, prefill compute included since layers stream while it runs. A duration, not a wall-clock
        deadline, so the two hosts' clocks need not agree: each side starts its own monotonic clock.
    secret: the handoff's secret (`HANDOFF_SECRET_NUM_BYTES` bytes), created by the receiver's `expect` and
        empty until then; the sender presents it and the receiver admits only the first sender that does.
        Not part of equality and never in `repr` (so not in logs or error messages).
    """

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
        """Payload bytes of one layer on the wire: values, plus one float32 scale per token on an int8 wire.

        DeepSeek-V3 per token per layer: bf16 576 * 2 = 1,152 B; int8 576 * 1 + 4 = 580 B.
        """
        num_bytes = self.num_tokens * self.kv_dim * DTYPES[self.wire_dtype].itemsize
        if self.is_int8_wire:
            num_bytes += self.num_tokens * INT8_SCALE_DTYPE.itemsize
        return num_bytes

    @property
    def total_wire_bytes(self) -> int:
        """KV payload bytes of the whole handoff (headers and extras not included)."""
        return self.layer_wire_bytes * self.num_layers


@dataclass
class HandoffExtras:
    """What decode needs besides the KV to continue at once, speculating with MTP at full acceptance.

    The prompt is not repeated here: decode's `reserve()` received it, and `HandoffMeta.num_tokens` (checked
    against the reservation) is its length.

    first_token_id: the token prefill sampled after the prompt.
    draft_token_ids: MTP draft tokens prefill proposed after `first_token_id` (may be empty).
    draft_probs: `[num_drafts, vocab_size]` float32 MTP probabilities of sampled (non-greedy) drafts, which
        lossless rejection sampling on decode needs; None for greedy drafts or no drafts.
    first_token_logprobs: the first token's `engine.outputs.TokenLogprobs` (computed on prefill, where its
        logits are) when the request asks for logprobs; None otherwise.
    """

    first_token_id: int
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    first_token_logprobs: TokenLogprobs | None = None


class ReceivedLayer(NamedTuple):
    """One layer as decode gets it.

    latent: `[num_tokens, kv_dim]` in the handoff's model dtype; int8 when the receiver passes an int8 wire
        through (its cache is int8).
    scale: `[num_tokens]` float32 per-token scales when `latent` is int8, else None.
    verified: False when the checksum is not checked yet: `on_layer` (registered with `on_layer_checksums`)
        returns the CRC-32C of `latent`'s bytes as it read them, and the receiver checks that afterwards.
    """

    latent: torch.Tensor
    scale: torch.Tensor | None = None
    verified: bool = True


# on_layer(layer_idx, layer): runs on the transport's receive thread once a layer arrived and verified
# (with `expect(..., on_layer_checksums=True)`: a float layer before it is verified; it returns the CRC-32C
# of the bytes it copied, which the receiver then checks).
LayerCallback = Callable[[int, ReceivedLayer], int | None]


@dataclass
class ReceivedKV:
    """A complete, verified handoff.

    layers: one `ReceivedLayer` per layer index; empty when an `on_layer` callback consumed them.
    num_wire_bytes: KV payload bytes received (`meta.total_wire_bytes`).
    elapsed_s: from `expect()` until the handoff completed (the transfer phase, prefill overlap included).
    """

    meta: HandoffMeta
    extras: HandoffExtras
    layers: list[ReceivedLayer]
    num_wire_bytes: int
    elapsed_s: float


class KVTransferError(RuntimeError):
    """A handoff failed; the request must be released on decode and re-dispatched."""


class TransferTimeout(KVTransferError):
    """The lease (or the caller's wait) ran out before the handoff completed: the sender stalled, died
    unseen, or is too slow. The message says how many layers arrived."""


class SenderLost(TransferTimeout):
    """The transport saw the sender go away (stream broken, connection closed, `close()`) before `finish`:
    raised at once instead of when the lease runs out. A TransferTimeout, so callers that treat "sender
    died" as a timeout need no second case. The message says how many layers arrived."""


class ChecksumMismatch(KVTransferError):
    """A layer's (or the extras') bytes do not match the sender's checksum; the message names the layer."""


class TransferAborted(KVTransferError):
    """The sender called `abort(request_id, reason)`; the message carries the reason."""


class ProtocolError(KVTransferError):
    """The two sides disagree: no reservation, a handoff that does not match it, a duplicate or
    out-of-range layer, `finish` before every layer."""


class HandoffRefused(ProtocolError):
    """A sender was not admitted to a handoff, before any of its data was accepted: no reservation, no
    secret or a wrong one, or the handoff already has its sender (a replay). Raised to that sender only:
    the reservation is not touched, so the real sender still delivers. The message never holds a secret."""


class FailureLog:
    """A sender's record of handoffs that failed and were not yet reported by `flush`: request id ->
    error only (no tensors, no call state), the oldest dropped beyond `max_records` so a sender nobody
    flushes holds bounded memory. Not thread-safe: callers hold their own lock."""

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


def check_begin(handoff: HandoffMeta, sender: str, closed: bool, begun: Container[str]) -> None:
    """What `KVSender.begin` refuses, for a sender named `sender` (its class), `closed` or not, that has
    `begun` (the request ids it still holds). Call with the sender's lock held.

    Raises:
        ValueError: no secret in `handoff`, or its request already begun. RuntimeError: the sender is closed.
    """
    if not handoff.secret:
        raise ValueError(f"{handoff.request_id}: the handoff has no secret; begin with what expect returned")
    if closed:
        raise RuntimeError(f"{sender} is closed")
    if handoff.request_id in begun:
        raise ValueError(f"{handoff.request_id}: handoff already begun")


class KVSender(abc.ABC):
    """Prefill side. Methods are called from one thread (the prefill actor's); delivery runs in the
    background. See the module docstring for the order of calls."""

    @abc.abstractmethod
    def begin(self, handoff: HandoffMeta) -> None:
        """Open the handoff: `handoff` is what decode's `expect` returned (it carries the secret).

        Raises:
            ValueError: `request_id` is already open, or `handoff.secret` is empty.
        """

    @abc.abstractmethod
    def send_layer(
        self, request_id: str, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        """Copy one layer's KV and enqueue it; returns before delivery.

        latent_kv: `[num_tokens, kv_dim]` in the model dtype; or int8 from an int8 KV cache, with
        scale: `[num_tokens]` float32 per-token scales (`kernels.kv_quant`). An int8 wire sends int8 + scales
            as they are (no re-quantization: the bytes decode's int8 cache gets are prefill's); a float wire
            sends them dequantized to the model dtype. None with a float `latent_kv`.

        ValueError for an unknown request, a layer index out of range, or a shape/dtype other than the
        handoff's. A request that already failed in the background (lease expired, decode refused it)
        silently drops further layers; `flush` reports the failure.
        """

    @abc.abstractmethod
    def finish(self, request_id: str, extras: HandoffExtras) -> None:
        """Enqueue the extras and close the handoff (every layer must have been sent). Non-blocking."""

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str) -> None:
        """Give the handoff up: layers not yet sent are dropped and decode's `wait` raises TransferAborted."""

    @abc.abstractmethod
    def flush(self, timeout_s: float) -> dict[str, KVTransferError]:
        """Wait until every request already finished or aborted was handed over, up to `timeout_s`.

        Returns `{request_id: error}` for the requests that failed since the last `flush` (and forgets them).
        Raises TransferTimeout if some finished request is still in flight after `timeout_s`.
        """

    @abc.abstractmethod
    def pending_request_ids(self) -> list[str]:
        """Requests begun and not yet closed (`finish`/`abort`) or, once closed, still being delivered (a
        leak check for tests: a delivered or failed request is not pending, flushed or not)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop: requests not finished are cut off (decode sees SenderLost or its lease expire)."""


class KVReceiver(abc.ABC):
    """Decode side. `expect`/`wait`/`release` are called from the decode actor's thread(s); data arrives on
    the transport's threads. See the module docstring for the order of calls."""

    @abc.abstractmethod
    def expect(
        self,
        handoff: HandoffMeta,
        on_layer: LayerCallback | None = None,
        on_layer_checksums: bool = False,
        block_ids: Sequence[int] | None = None,
    ) -> HandoffMeta:
        """Register a reservation and start its lease; returns `handoff` with a fresh `secret`, the one to
        give the sender (and nobody else).

        `block_ids`: the reserved blocks the layers go to, in position order, in the KV cache the receiver
        was given (`ShmKVReceiver.share_kv_cache`): a same-host sender then writes them there itself
        (`shm_transport.inplace`) and `on_layer` is not called; free those blocks only once the cache's
        fences allow it (`SharedKVCache.fences`, as `DecodeNode._release_reserved` does). Receivers
        without a shared cache ignore it.

        `on_layer_checksums`: `on_layer` returns the CRC-32C of a float layer's bytes, computed as it copies
        them (`kernels.paged_mla.write_prompt_kv(checksum_start=0)`), and is called before the receiver
        verifies the layer (float wires received into host memory; int8 wires and device payloads are
        verified first, `ReceivedLayer.verified` says which); a mismatch then fails the handoff as an
        unverified layer would. Only for a callback whose writes nobody reads before the handoff completes
        (decode's reserved blocks).

        Raises:
            ValueError: `request_id` is already reserved, or `handoff` already carries a secret (the
                receiver creates it).
        """

    @abc.abstractmethod
    def wait(self, request_id: str, timeout_s: float) -> ReceivedKV:
        """Block until the handoff is complete and verified; raise a `KVTransferError` subclass otherwise
        (TransferTimeout after `min(lease, timeout_s)`). KeyError if `request_id` was not expected."""

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget the reservation, whatever its state (no-op if unknown); after it, no `on_layer` runs."""

    @abc.abstractmethod
    def pending_request_ids(self) -> list[str]:
        """Reservations not yet released (a leak check for tests)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop receiving; pending reservations are left to the caller to release."""
