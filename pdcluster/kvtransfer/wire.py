"""Wire format of one handoff, shared by both transports."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import crc32c
import numpy as np
import torch

from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.kernels.kv_quant import dequantize_kv_int8, quantize_kv_int8
from pdcluster.kernels.paged_mla import bytes_crc32c
from pdcluster.kvtransfer.base import (
    INT8_SCALE_DTYPE,
    ChecksumMismatch,
    HandoffExtras,
    HandoffMeta,
    ProtocolError,
    ReceivedLayer,
)
from pdcluster.models.dtypes import dtype_name, torch_dtype

if sys.byteorder != "little":  # raw tensor bytes go on the wire as the host lays them out
    raise ImportError("kvtransfer's wire format is little-endian; this host is big-endian")


@dataclass(frozen=True)
class LayerHeader:
    """Describes one layer's payload.

    num_bytes: payload bytes (values, plus `num_tokens` float32 scales on an int8 wire).
    """

    request_id: str
    layer_idx: int
    num_tokens: int
    kv_dim: int
    dtype: str
    wire_dtype: str
    num_bytes: int
    checksum: int

    def to_dict(self) -> dict[str, Any]:
        # field by field: `asdict` deep-copies
        return {
            "request_id": self.request_id,
            "layer_idx": self.layer_idx,
            "num_tokens": self.num_tokens,
            "kv_dim": self.kv_dim,
            "dtype": self.dtype,
            "wire_dtype": self.wire_dtype,
            "num_bytes": self.num_bytes,
            "checksum": self.checksum,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> LayerHeader:
        try:
            return cls(**record)
        except TypeError as e:
            raise ProtocolError(f"malformed layer header {record!r}: {e}") from None


class EncodedLayer(NamedTuple):
    """A layer ready to send: `payload` is a 1-D uint8 CPU tensor of `header.num_bytes` bytes."""

    header: LayerHeader
    payload: torch.Tensor


# Test-only, in senders: sees each layer's header and a mutable payload copy; False stalls the request.
FaultHook = Callable[[LayerHeader, bytearray], bool]


def checksum(data: Any, start: int = 0) -> int:
    """CRC-32C (unsigned 32-bit int) of a bytes-like object (bytes, memoryview, C-contiguous numpy array),
    chained from `start`: `checksum(b, checksum(a)) == checksum(a + b)`. Releases the GIL from 32 KiB on."""
    return crc32c.crc32c(data, start)


COPY_CHUNK_BYTES = 256 << 10  # copied then checksummed while in cache (L2-sized; a whole layer is not)


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor | memoryview | bytes, start: int = 0) -> int:
    """Copy `src` into `dst` (1-D uint8 CPU, same length) chunk by chunk, checksumming each chunk while
    in cache; returns the CRC-32C of the bytes, chained from `start`."""
    src_np = src.numpy() if isinstance(src, torch.Tensor) else np.frombuffer(src, dtype=np.uint8)
    if dst.numel() != src_np.size:
        raise ValueError(f"copy_with_checksum: {src_np.size} B into {dst.numel()} B")
    dst_np, crc = dst.numpy(), start
    for offset in range(0, dst_np.size, COPY_CHUNK_BYTES):
        chunk = dst_np[offset : offset + COPY_CHUNK_BYTES]
        np.copyto(chunk, src_np[offset : offset + COPY_CHUNK_BYTES])
        crc = crc32c.crc32c(chunk, crc)
    return crc


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `tensor` as a 1-D uint8 CPU tensor (a view when already contiguous on CPU)."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def check_layer(
    meta: HandoffMeta, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None = None
) -> None:
    """ValueError unless the index is in range and `latent_kv` is `[num_tokens, kv_dim]` in `meta.dtype`
    (`scale` None), or int8 with `scale` `[num_tokens]` float32 (an int8 KV cache's layer)."""
    if not 0 <= layer_idx < meta.num_layers:
        raise ValueError(f"{meta.request_id}: layer_idx {layer_idx} out of range [0, {meta.num_layers})")
    expected = (meta.num_tokens, meta.kv_dim)
    dtype = meta.torch_dtype if scale is None else torch.int8
    if tuple(latent_kv.shape) != expected or latent_kv.dtype != dtype:
        raise ValueError(
            f"{meta.request_id}: layer {layer_idx} latent_kv must be {list(expected)} {dtype_name(dtype)}, "
            f"got {list(latent_kv.shape)} {dtype_name(latent_kv.dtype)}"
        )
    if scale is not None and (tuple(scale.shape) != expected[:1] or scale.dtype != INT8_SCALE_DTYPE):
        raise ValueError(
            f"{meta.request_id}: layer {layer_idx} scale must be [{meta.num_tokens}] float32, "
            f"got {list(scale.shape)} {dtype_name(scale.dtype)}"
        )


def copy_layer(
    meta: HandoffMeta, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`check_layer`, then copies of the tensors (what a sender queues: the caller may reuse its buffers)."""
    check_layer(meta, layer_idx, latent_kv, scale)
    return latent_kv.detach().clone(), None if scale is None else scale.detach().clone()


def encode_layer(
    meta: HandoffMeta, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None = None
) -> EncodedLayer:
    """Payload and header of one layer; `latent_kv` / `scale` as `check_layer` demands.

    int8 wire: float `latent_kv` is quantized; int8 `latent_kv` + `scale` go as they are (same bytes).
    Float wire: float `latent_kv` goes raw; int8 + `scale` is dequantized to the model dtype.
    """
    if scale is not None and not meta.is_int8_wire:
        latent_kv, scale = dequantize_kv_int8(latent_kv, scale, meta.torch_dtype), None
    if meta.is_int8_wire:
        if scale is None:
            latent_kv, scale = quantize_kv_int8(latent_kv)  # [num_tokens, kv_dim] int8, [num_tokens] float32
        payload = torch.cat([tensor_bytes(latent_kv), tensor_bytes(scale.to(INT8_SCALE_DTYPE))])
    else:
        payload = tensor_bytes(latent_kv)
    if payload.numel() != meta.layer_wire_bytes:
        raise AssertionError(f"layer payload {payload.numel()} B != {meta.layer_wire_bytes} B")
    return EncodedLayer(layer_header(meta, layer_idx, payload), payload)


# what a layer header repeats of its handoff
_META_FIELDS = ("request_id", "num_tokens", "kv_dim", "dtype", "wire_dtype")


def layer_header(
    meta: HandoffMeta, layer_idx: int, payload: torch.Tensor | None, crc: int | None = None
) -> LayerHeader:
    """The header of layer `layer_idx`'s `payload` (1-D uint8, on the host): its length and CRC-32C
    (`crc` when the caller already has it, e.g. from `copy_with_checksum`).
    """
    if payload is None and crc is None:
        raise ValueError("layer_header: a header without its payload needs the payload's crc")
    return LayerHeader(
        **{name: getattr(meta, name) for name in _META_FIELDS},
        layer_idx=layer_idx,
        num_bytes=meta.layer_wire_bytes if payload is None else payload.numel(),
        checksum=crc if crc is not None else checksum(payload.numpy()),  # type: ignore[union-attr]
    )


def apply_fault_hook(hook: FaultHook | None, layer: EncodedLayer) -> tuple[EncodedLayer, bool]:
    """`(layer, True)` without a hook; with one, the layer with the hook's changes and whether to go on."""
    if hook is None:
        return layer, True
    data = bytearray(layer.payload.numpy().tobytes())
    keep_sending = hook(layer.header, data)
    return EncodedLayer(layer.header, torch.frombuffer(data, dtype=torch.uint8)), keep_sending


def check_header(meta: HandoffMeta, header: LayerHeader) -> None:
    """ProtocolError unless the header matches the reservation's handoff."""
    expected = (
        meta.request_id,
        meta.num_tokens,
        meta.kv_dim,
        meta.dtype,
        meta.wire_dtype,
        meta.layer_wire_bytes,
    )
    got = (
        header.request_id,
        header.num_tokens,
        header.kv_dim,
        header.dtype,
        header.wire_dtype,
        header.num_bytes,
    )
    if got != expected:
        names = ("request_id", "num_tokens", "kv_dim", "dtype", "wire_dtype", "num_bytes")
        diffs = [f"{n} {g!r} != {e!r}" for n, g, e in zip(names, got, expected, strict=True) if g != e]
        raise ProtocolError(
            f"{meta.request_id}: layer {header.layer_idx} header disagrees with the handoff: {diffs}"
        )
    if not 0 <= header.layer_idx < meta.num_layers:
        raise ProtocolError(
            f"{meta.request_id}: layer_idx {header.layer_idx} out of range [0, {meta.num_layers})"
        )


def check_payload_length(header: LayerHeader, payload: torch.Tensor) -> None:
    """ChecksumMismatch naming the layer unless `payload` (1-D uint8) has the header's length."""
    if payload.numel() != header.num_bytes:
        raise ChecksumMismatch(
            f"{header.request_id}: layer {header.layer_idx} payload is {payload.numel()} B, "
            f"header says {header.num_bytes} B"
        )


def verify_layer(header: LayerHeader, payload: torch.Tensor, got: int | None = None) -> None:
    """ChecksumMismatch naming the layer unless `payload` (1-D uint8) has the header's length and CRC
    (`got`: its CRC-32C already computed by the caller, e.g. `copy_with_checksum` while copying it)."""
    check_payload_length(header, payload)
    if got is None:
        got = checksum(payload.cpu().numpy())  # a host copy for accelerator-resident payloads
    if got != header.checksum:
        raise ChecksumMismatch(
            f"{header.request_id}: checksum mismatch on layer {header.layer_idx} "
            f"(crc32c {got:#010x} != sender's {header.checksum:#010x}, {header.num_bytes} B)"
        )


def decode_layer(header: LayerHeader, payload: torch.Tensor, int8_passthrough: bool = False) -> ReceivedLayer:
    """The tensors of a payload (1-D uint8 of the header's length, any device; verified, or to be verified by
    the callback it goes to): views of it on a float wire.

    int8 wire: dequantized to the model dtype, or `(int8 values, float32 scales)` with `int8_passthrough`.
    """
    num_tokens, kv_dim = header.num_tokens, header.kv_dim
    if header.wire_dtype != "int8":
        return ReceivedLayer(payload.view(torch_dtype(header.wire_dtype)).view(num_tokens, kv_dim))
    num_value_bytes = num_tokens * kv_dim * torch.int8.itemsize
    latent_int8 = payload[:num_value_bytes].view(torch.int8).view(num_tokens, kv_dim)
    scale = payload[num_value_bytes:].view(INT8_SCALE_DTYPE)  # [num_tokens]
    if int8_passthrough:
        return ReceivedLayer(latent_int8, scale)
    return ReceivedLayer(dequantize_kv_int8(latent_int8, scale, torch_dtype(header.dtype)))


def meta_to_dict(meta: HandoffMeta) -> dict[str, Any]:
    """The handoff as a msgpack-ready dict, its `secret` included (torch.distributed's begin record)."""
    return asdict(meta)


def meta_from_dict(record: dict[str, Any]) -> HandoffMeta:
    """Inverse of `meta_to_dict`; ProtocolError for a malformed record (its message leaves out the secret)."""
    try:
        return HandoffMeta(**record)
    except (TypeError, ValueError) as e:
        shown = {k: v for k, v in record.items() if k != "secret"} if isinstance(record, dict) else record
        raise ProtocolError(f"malformed handoff {shown!r}: {e}") from None


def extras_checksum(extras: HandoffExtras) -> int:
    """CRC-32C over the extras in a fixed order: token ids as int64 (the drafts with their count), then the
    raw bytes of `draft_probs` (if any), then the first token's logprobs (if any: rank and top ids as
    int64, logprobs as float64).
    """
    ids = [extras.first_token_id, len(extras.draft_token_ids), *extras.draft_token_ids]
    crc = checksum(np.asarray(ids, dtype="<i8"))
    if extras.draft_probs is not None:
        crc = bytes_crc32c(extras.draft_probs, crc)
    logprobs = extras.first_token_logprobs
    if logprobs is not None:
        crc = checksum(np.asarray([logprobs.rank, *logprobs.top_token_ids], dtype="<i8"), crc)
        crc = checksum(np.asarray([logprobs.logprob, *logprobs.top_logprobs], dtype="<f8"), crc)
    return crc


def logprobs_to_list(logprobs: TokenLogprobs | None) -> list[Any] | None:
    """A `TokenLogprobs` as a msgpack-ready list (None stays None)."""
    if logprobs is None:
        return None
    return [logprobs.token_id, logprobs.logprob, logprobs.rank, logprobs.top_token_ids, logprobs.top_logprobs]


def logprobs_from_list(fields: Any) -> TokenLogprobs | None:
    """Inverse of `logprobs_to_list`. ValueError naming what is malformed."""
    if fields is None:
        return None
    if not isinstance(fields, list | tuple) or len(fields) != 5:
        raise ValueError(f"token logprobs must be [id, logprob, rank, top ids, top logprobs]: {fields!r}")
    token_id, logprob, rank, top_ids, top_logprobs = fields
    if not isinstance(token_id, int) or not isinstance(rank, int) or not isinstance(logprob, float):
        raise ValueError(f"token logprobs {fields!r}: token_id and rank must be ints, logprob a float")
    if not all(isinstance(t, int) for t in top_ids) or not all(isinstance(v, float) for v in top_logprobs):
        raise ValueError(f"token logprobs {fields!r}: top ids must be ints, top logprobs floats")
    if len(top_ids) != len(top_logprobs):
        raise ValueError(f"token logprobs {fields!r}: {len(top_ids)} top ids, {len(top_logprobs)} logprobs")
    return TokenLogprobs(token_id, logprob, rank, list(top_ids), list(top_logprobs))


def tensor_to_record(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as `{"dtype", "shape", "data"}` (raw bytes), bit-exact."""
    return {
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "data": tensor_bytes(tensor).numpy().tobytes(),
    }


def tensor_from_record(record: dict[str, Any]) -> torch.Tensor:
    data = bytearray(record["data"])  # writable, so torch.frombuffer shares it without a warning
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(torch_dtype(record["dtype"])).view(record["shape"])


def extras_to_dict(extras: HandoffExtras) -> dict[str, Any]:
    """The extras as a msgpack-ready dict, with their checksum."""
    return {
        "first_token_id": extras.first_token_id,
        "draft_token_ids": list(extras.draft_token_ids),
        "draft_probs": None if extras.draft_probs is None else tensor_to_record(extras.draft_probs),
        "logprobs": logprobs_to_list(extras.first_token_logprobs),
        "checksum": extras_checksum(extras),
    }


def extras_from_dict(request_id: str, record: dict[str, Any]) -> HandoffExtras:
    """Inverse of `extras_to_dict`; ChecksumMismatch if the extras were corrupted."""
    try:
        extras = HandoffExtras(
            first_token_id=record["first_token_id"],
            draft_token_ids=list(record["draft_token_ids"]),
            draft_probs=None if record["draft_probs"] is None else tensor_from_record(record["draft_probs"]),
            first_token_logprobs=logprobs_from_list(record.get("logprobs")),
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ProtocolError(f"{request_id}: malformed extras: {e}") from None
    verify_extras(request_id, extras, record["checksum"])
    return extras


def verify_extras(request_id: str, extras: HandoffExtras, expected_checksum: int) -> None:
    got = extras_checksum(extras)
    if got != expected_checksum:
        raise ChecksumMismatch(
            f"{request_id}: checksum mismatch on the extras (crc32c {got:#010x} != {expected_checksum:#010x})"
        )
