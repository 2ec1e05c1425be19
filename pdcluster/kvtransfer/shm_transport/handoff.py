"""One handoff on the shm sender: its state, and its layers' writes into a segment or decode's blocks."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from pdcluster.kernels.paged_mla import gather_kv, write_prompt_kv
from pdcluster.kvtransfer.base import ERROR_CLASSES, HandoffMeta, KVTransferError
from pdcluster.kvtransfer.sending import TrackedHandoff
from pdcluster.kvtransfer.shm_transport.inplace import CacheLayout, SharedKVCache, check_block_table
from pdcluster.kvtransfer.shm_transport.segments import Segment
from pdcluster.kvtransfer.wire import (
    EncodedLayer,
    FaultHook,
    LayerHeader,
    copy_with_checksum,
    layer_header,
    tensor_bytes,
)
from pdcluster.models.dtypes import torch_dtype


def error_from_record(record: list[str] | None) -> KVTransferError | None:
    """The error a `done` record carries, as its class; None: delivered."""
    if record is None:
        return None
    name, message = record
    return ERROR_CLASSES.get(name, KVTransferError)(message)


def encoded_dtype(meta: HandoffMeta) -> torch.dtype:
    return torch_dtype(meta.wire_dtype)


def written_header(meta: HandoffMeta, layer_idx: int, crc: int) -> LayerHeader:
    return layer_header(meta, layer_idx, None, crc)


def is_raw(meta: HandoffMeta, scale: torch.Tensor | None) -> bool:
    return (scale is None) != meta.is_int8_wire


@dataclass
class SendingHandoff(TrackedHandoff):
    """A handoff's sender-side state; every write into shared memory holds `write_lock`."""

    segment: Segment | None = None
    blocks: np.ndarray | None = None
    cache: SharedKVCache | None = None
    granted: threading.Event = field(default_factory=threading.Event)
    sent_layers: set[int] = field(default_factory=set)
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    def region(self, layer_idx: int) -> torch.Tensor:
        assert self.segment is not None
        num_bytes = self.meta.layer_wire_bytes
        return self.segment.view(layer_idx * num_bytes, num_bytes)

    def write_raw(self, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None) -> int:
        """Copy a layer already in wire form where it goes; returns the CRC-32C of what was written."""
        if self.blocks is not None:
            return self.write_in_place(layer_idx, latent_kv)
        region = self.region(layer_idx)
        num_value_bytes = latent_kv.numel() * latent_kv.element_size()
        crc = copy_with_checksum(region[:num_value_bytes], tensor_bytes(latent_kv))
        if scale is not None:
            crc = copy_with_checksum(region[num_value_bytes:], tensor_bytes(scale), crc)
        return crc

    def write_encoded(self, layer_idx: int, encoded: EncodedLayer) -> LayerHeader:
        meta = self.meta
        if self.blocks is not None:
            latent = encoded.payload.view(encoded_dtype(meta)).view(meta.num_tokens, meta.kv_dim)
            return written_header(meta, layer_idx, self.write_in_place(layer_idx, latent))
        np.copyto(self.region(layer_idx).numpy(), encoded.payload.numpy())
        return encoded.header

    def write_in_place(self, layer_idx: int, latent_kv: torch.Tensor) -> int:
        assert self.cache is not None and self.blocks is not None
        crc = write_prompt_kv(
            self.cache.layers[layer_idx], latent_kv, torch.from_numpy(self.blocks), checksum_start=0
        )
        assert crc is not None
        return crc

    def run_fault_hook(self, layer_idx: int, header: LayerHeader, fault_hook: FaultHook) -> bool:
        """Let the test hook rewrite the layer as written; False: send nothing more of it."""
        with self.write_lock:
            if self.done:
                return False
            data = bytearray(self._written_bytes(layer_idx))
        keep_sending = fault_hook(header, data)
        with self.write_lock:
            if self.done:
                return False
            self._rewrite(layer_idx, torch.frombuffer(data, dtype=torch.uint8))
        if not keep_sending:
            self.stalled = True
            return False
        return True

    def _written_bytes(self, layer_idx: int) -> bytes:
        if self.blocks is None:
            return self.region(layer_idx).numpy().tobytes()
        assert self.cache is not None
        layer = self.cache.layers[layer_idx]
        latent, _ = gather_kv(layer, torch.from_numpy(self.blocks), self.meta.num_tokens)
        return latent.contiguous().view(torch.uint8).numpy().tobytes()

    def _rewrite(self, layer_idx: int, data: torch.Tensor) -> None:
        if self.blocks is None:
            self.region(layer_idx).copy_(data)
            return
        latent = data.view(encoded_dtype(self.meta)).view(self.meta.num_tokens, self.meta.kv_dim)
        self.write_in_place(layer_idx, latent)


def in_place_blocks(meta: HandoffMeta, cache: SharedKVCache | None, block_ids: object) -> np.ndarray:
    """The granted block table, checked against the handoff and the mapped cache; ValueError if unusable."""
    if cache is None:
        raise ValueError("no shared KV cache was mapped on this connection")
    layout = cache.layout
    fits = (meta.dtype, meta.wire_dtype, meta.kv_dim) == (layout.dtype, layout.dtype, layout.kv_dim)
    if not fits or meta.num_layers > layout.num_layers:
        raise ValueError(f"the handoff {meta} does not fit the cache {layout}")
    return check_block_table(layout, block_ids, meta.num_tokens)


class SenderMappings:
    """The segments and the shared KV cache decode passed on one connection, mapped here."""

    def __init__(self) -> None:
        self.segments: dict[int, Segment] = {}
        self.cache: SharedKVCache | None = None

    def map_segment(self, record: dict, fds: list[int]) -> Segment | None:
        """The segment a grant names, mapping its descriptor (popped from `fds`) when it brings one."""
        segment_id, capacity = record["seg"], record["cap"]
        if not isinstance(segment_id, int) or not isinstance(capacity, int):
            raise TypeError(f"a grant's seg and cap must be ints, got {segment_id!r}, {capacity!r}")
        if fds:
            segment = Segment(segment_id, capacity, fd=fds.pop(0))  # it owns the descriptor (closes it
            segment.close_fd()  # if it cannot map it); the mapping stays
            replaced = self.segments.pop(segment_id, None)
            if replaced is not None:
                replaced.close()
            self.segments[segment_id] = segment
        return self.segments.get(segment_id)

    def map_cache(self, record: dict, fds: list[int]) -> str | None:
        """Map the cache an in-place grant brings; why it cannot be mapped, or None."""
        try:
            layout = CacheLayout.from_dict(record["cache"])
            if self.cache is not None:
                raise ValueError("a second shared KV cache on one connection")
            if not fds:
                raise ValueError("an in-place grant with a cache layout came without its descriptor")
            self.cache = SharedKVCache.map(fds.pop(0), layout)
        except (KeyError, TypeError, ValueError, OSError) as e:
            return f"its cache cannot be mapped: {e!r}"
        return None

    def drop(self, segment_ids: list[int]) -> None:
        for segment_id in segment_ids:
            segment = self.segments.pop(segment_id, None)
            if segment is not None:
                segment.close()

    def take_segments(self) -> list[Segment]:
        """Forget every segment and the cache; the segments, for the caller to close."""
        segments, self.segments, self.cache = list(self.segments.values()), {}, None
        return segments
