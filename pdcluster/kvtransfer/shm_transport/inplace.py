"""In-place handoffs: prefill writes each layer straight into decode's paged KV cache.

Decode's float cache is one sealed memfd (`SharedKVCache`); the sender gets its descriptor once per
connection and a block table per handoff, writes each layer with `kernels.paged_mla.write_prompt_kv`
computing the CRC-32C in the same pass, and decode checks `stored_checksum` of its blocks.
Fencing: decode frees a handoff's blocks only once its sender can no longer write them (its finish,
abort or end, its connection closed, or its process gone), whatever the lease says (`FenceBoard`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import torch

from pdcluster.kvtransfer.shm_transport.segments import anonymous_fd, size_is_sealed
from pdcluster.models.dtypes import MODEL_DTYPES, dtype_name, torch_dtype

logger = logging.getLogger(__name__)

CACHE_MEMFD_NAME = "pdcluster-kv-cache"
LAYOUT_KEYS = ("layers", "blocks", "block_size", "kv_dim", "dtype")  # a `CacheLayout` record, in field order


@dataclass(frozen=True)
class CacheLayout:
    """Layer `i`, block `b` of a shared cache starts at byte `i * layer_bytes + b * block_bytes`."""

    num_layers: int
    num_blocks: int
    block_size: int
    kv_dim: int
    dtype: str

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_dim * torch_dtype(self.dtype).itemsize

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def to_dict(self) -> dict[str, Any]:
        return dict(zip(LAYOUT_KEYS, dataclasses.astuple(self), strict=True))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> CacheLayout:
        """Raises TypeError/ValueError on a malformed record."""
        ints = [record[k] for k in LAYOUT_KEYS[:-1]]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ints):
            raise TypeError(f"a cache layout needs positive ints, got {ints!r}")
        torch_dtype(record["dtype"], "cache layout dtype", MODEL_DTYPES)
        return cls(*ints, dtype=record["dtype"])


class SharedKVCache:
    """A paged KV cache in one anonymous shared-memory file.

    layers[i]: [num_blocks, block_size, kv_dim] model dtype, zeros at first (as `ModelRunner.kv_caches`).
    Decode `create`s it and keeps `fd` to pass on; a sender `map`s it. Raises OSError (create) if too large.
    """

    def __init__(self, layout: CacheLayout, fd: int) -> None:
        self.layout = layout
        self.fd: int | None = fd
        self._mmap = mmap.mmap(fd, max(1, layout.total_bytes))
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        shape = (layout.num_blocks, layout.block_size, layout.kv_dim)
        dtype = torch_dtype(layout.dtype)
        self.layers = [
            flat[i * layout.layer_bytes : (i + 1) * layout.layer_bytes].view(dtype).view(shape)
            for i in range(layout.num_layers)
        ]
        self.fences = FenceBoard()

    @classmethod
    def create(cls, layout: CacheLayout) -> SharedKVCache:
        fd = anonymous_fd(layout.total_bytes, CACHE_MEMFD_NAME, seal_size=True)
        try:
            return cls(layout, fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def map(cls, fd: int, layout: CacheLayout) -> SharedKVCache:
        """Map a cache decode shared; closes `fd` in any case.

        Raises ValueError (file too small, size not sealed) or OSError (cannot map).
        """
        try:
            size = os.fstat(fd).st_size
            if size < layout.total_bytes:
                raise ValueError(f"shared KV cache file is {size} B, its layout needs {layout.total_bytes}")
            sealed = size_is_sealed(fd)
            if sealed is False or (sealed is None and hasattr(fcntl, "F_GET_SEALS")):
                raise ValueError("shared KV cache file: its size is not sealed (it could be truncated)")
            cache = cls(layout, fd)
        finally:
            os.close(fd)
        cache.fd = None
        return cache

    @staticmethod
    def for_tensors(num_layers: int, shape: tuple[int, int, int], dtype: torch.dtype) -> SharedKVCache:
        num_blocks, block_size, kv_dim = shape
        return SharedKVCache.create(
            CacheLayout(num_layers, num_blocks, block_size, kv_dim, dtype_name(dtype))
        )


def check_block_table(layout: CacheLayout, block_ids: Any, num_tokens: int) -> np.ndarray:
    """`block_ids` as int64; ValueError if too few for `num_tokens` or out of `[0, num_blocks)`."""
    try:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    except (OverflowError, TypeError, ValueError) as e:
        raise ValueError(f"a block table must be integers in int64: {e}") from None
    needed = -(-num_tokens // layout.block_size)
    if ids.size < needed:
        raise ValueError(f"{ids.size} blocks cannot hold {num_tokens} tokens of {layout.block_size}")
    ids = ids[:needed]
    if needed and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_blocks):
        raise ValueError(f"block ids outside the cache's {layout.num_blocks} blocks")
    return ids


def stored_checksum(cache_layer: torch.Tensor, block_ids: np.ndarray, num_tokens: int) -> int:
    """CRC-32C of positions `0 .. num_tokens - 1` in `cache_layer` through `block_ids`, in position order.

    cache_layer: [num_blocks, block_size, kv_dim] on the host; equals the CRC of the source written.
    """
    num_blocks, block_size, kv_dim = cache_layer.shape
    rows = cache_layer.view(torch.uint8).numpy().reshape(num_blocks, -1)
    row_bytes = kv_dim * cache_layer.element_size()
    num_full, tail = divmod(num_tokens, block_size)
    crc = 0
    for block in block_ids[:num_full]:
        crc = crc32c.crc32c(rows[block], crc)
    if tail:
        crc = crc32c.crc32c(rows[block_ids[num_full], : tail * row_bytes], crc)
    return crc


@dataclass
class _Fence:
    frees: list[Callable[[], None]] = field(default_factory=list)


class FenceBoard:
    """In-place handoffs whose sender may still write the cache: `open` at grant, `end` when it cannot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fences: dict[str, _Fence] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._fences)

    def open(self, request_id: str, still_wanted: Callable[[], bool]) -> bool:
        """Fence `request_id` if `still_wanted()` (asked under the lock); False: do not grant."""
        with self._lock:
            if not still_wanted():
                return False
            self._fences.setdefault(request_id, _Fence())
            return True

    def defer(self, request_id: str, free: Callable[[], None]) -> bool:
        """True (and `free` called on a thread at `end`) while fenced; False: the caller frees now."""
        with self._lock:
            fence = self._fences.get(request_id)
            if fence is None:
                return False
            fence.frees.append(free)
            return True

    def end(self, request_id: str) -> None:
        with self._lock:
            fence = self._fences.pop(request_id, None)
        if fence is not None and fence.frees:
            threading.Thread(
                target=_run_all, args=(fence.frees,), name="kv-inplace-free", daemon=True
            ).start()


def _run_all(frees: list[Callable[[], None]]) -> None:
    for free in frees:
        try:
            free()
        except Exception:  # noqa: BLE001 - one caller's failure must not skip the others
            logger.exception("kv shm: freeing in-place blocks failed")
