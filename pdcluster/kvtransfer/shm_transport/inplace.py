"""In-place handoffs: prefill writes each layer straight into decode's paged KV cache.

Decode keeps its float KV cache in one anonymous shared-memory file (`SharedKVCache`: `memfd_create`, as a
segment; layer `i` is `[num_blocks, block_size, kv_dim]` at byte `i * layout.layer_bytes`). The shm
receiver passes its descriptor, once per connection, to a prefill sender it admitted, and grants each
handoff the block table decode reserved for it; the sender then copies a layer from its own tensor into
those blocks (`kernels.paged_mla.write_prompt_kv`, the CRC-32C of the source computed in the same pass)
and sends the header with that CRC, and decode computes the CRC of what its blocks hold (`stored_checksum`,
a read pass) before it counts the layer as arrived. One copy per byte instead of two (into a segment,
then into the blocks).

Fencing. A sender that can write into decode's cache could write into blocks decode has freed and given to
another request. So decode frees an in-place handoff's blocks only once its sender can no longer write
them: the sender said so (its `finish`, `abort` or `end` record: it writes nothing after sending one), its
connection ended from its side (a sender stops writing every handoff before it closes its socket, and a
dead process writes nothing), or, when decode ended the connection itself, once the sender closed its
side after seeing that end (decode half-closes and waits) or its process is gone. Until then the blocks
stay reserved (`FenceBoard.defer`, `DecodeNode._release_reserved`). A sender whose lease
expired but that is stopped (SIGSTOP) therefore keeps its blocks held until it runs again or dies; it can
never write into blocks another request owns. The fences live with the cache (`SharedKVCache.fences`,
a `FenceBoard`), not with a receiver, so a receiver closed or replaced (a rewire) forgets none of them.

The cache file's size is sealed (`F_SEAL_SHRINK`, `F_SEAL_GROW`): a sender cannot truncate it under
decode's mappings (which would crash decode with SIGBUS), and a sender maps only a sealed memfd.
"""

from __future__ import annotations

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

CACHE_MEMFD_NAME = "pdcluster-kv-cache"  # in /proc/<pid>/maps: "/memfd:pdcluster-kv-cache (deleted)"


@dataclass(frozen=True)
class CacheLayout:
    """Where a shared KV cache's layers and blocks are: layer `i`, block `b` starts at byte
    `i * layer_bytes + b * block_bytes`; a block holds `block_size` rows of `kv_dim` values of `dtype`."""

    num_layers: int
    num_blocks: int
    block_size: int
    kv_dim: int
    dtype: str  # a model dtype name: "bfloat16", "float16", "float32"

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
        return {
            "layers": self.num_layers,
            "blocks": self.num_blocks,
            "block_size": self.block_size,
            "kv_dim": self.kv_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> CacheLayout:
        """Raises TypeError/ValueError on a malformed record (not positive ints, not a model dtype)."""
        ints = [record[k] for k in ("layers", "blocks", "block_size", "kv_dim")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ints):
            raise TypeError(f"a cache layout needs positive ints, got {ints!r}")
        torch_dtype(record["dtype"], "cache layout dtype", MODEL_DTYPES)
        return cls(*ints, dtype=record["dtype"])


class SharedKVCache:
    """A paged KV cache in one anonymous shared-memory file: `layers[i]` is `[num_blocks, block_size,
    kv_dim]` of the model dtype (zeros at first), the same shape and dtype as `ModelRunner.kv_caches`.

    Decode creates it (`SharedKVCache.create`) and keeps `fd` open to pass to senders; a sender maps the
    descriptor it received (`SharedKVCache.map`, which takes ownership of it). The memory goes when the
    last mapping and descriptor go (nothing is ever named in /dev/shm).

    Raises (create): OSError when the file cannot be made that large.
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
        self.fences = FenceBoard()  # decode's: in-place handoffs whose sender may still write

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
        """Map a cache decode shared (`fd`, which this closes once mapped, mapped or not).

        Raises:
            ValueError: the file is smaller than `layout` says, or a memfd whose size is not sealed.
            OSError: it cannot be mapped.
        """
        try:
            size = os.fstat(fd).st_size
            if size < layout.total_bytes:
                raise ValueError(f"shared KV cache file is {size} B, its layout needs {layout.total_bytes}")
            sealed = size_is_sealed(fd)  # None: not a memfd (or no seals on this platform)
            if sealed is False or (sealed is None and hasattr(fcntl, "F_GET_SEALS")):
                raise ValueError("shared KV cache file: its size is not sealed (it could be truncated)")
            cache = cls(layout, fd)
        finally:
            os.close(fd)
        cache.fd = None
        return cache

    @staticmethod
    def for_tensors(num_layers: int, shape: tuple[int, int, int], dtype: torch.dtype) -> SharedKVCache:
        """`num_layers` zeroed `shape` (`[num_blocks, block_size, kv_dim]`) caches of `dtype` in one file."""
        num_blocks, block_size, kv_dim = shape
        return SharedKVCache.create(
            CacheLayout(num_layers, num_blocks, block_size, kv_dim, dtype_name(dtype))
        )


def check_block_table(layout: CacheLayout, block_ids: Any, num_tokens: int) -> np.ndarray:
    """`block_ids` as int64, checked to cover `num_tokens` positions within the cache's blocks.

    Raises:
        ValueError: too few blocks, or a block id outside `[0, layout.num_blocks)`.
    """
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
    """CRC-32C (Castagnoli) of positions `0 .. num_tokens - 1` as stored in `cache_layer` (`[num_blocks,
    block_size, kv_dim]`, host) through `block_ids` (checked, `check_block_table`), in position order: the
    same value as the CRC of the `[num_tokens, kv_dim]` tensor written there (`write_prompt_kv`)."""
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
    frees: list[Callable[[], None]] = field(default_factory=list)  # `defer`'s callbacks


class FenceBoard:
    """The in-place handoffs, by request id, whose sender may still write the cache (the module
    docstring): `open` at the grant, `end` when the sender can no longer write. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fences: dict[str, _Fence] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._fences)

    def open(self, request_id: str, still_wanted: Callable[[], bool]) -> bool:
        """Fence `request_id` if `still_wanted()` (asked under the board's lock: decode releases a
        reservation before it asks `defer`, so a grant either sees the release or is fenced before `defer`
        looks). False: not fenced, do not grant."""
        with self._lock:
            if not still_wanted():
                return False
            self._fences.setdefault(request_id, _Fence())
            return True

    def defer(self, request_id: str, free: Callable[[], None]) -> bool:
        """True (and `free` called, on a thread, at `end`) while `request_id` is fenced; False: not fenced,
        the caller frees now and `free` is never called."""
        with self._lock:
            fence = self._fences.get(request_id)
            if fence is None:
                return False
            fence.frees.append(free)
            return True

    def end(self, request_id: str) -> None:
        """The sender of `request_id` can no longer write: what waited for that runs, on a thread."""
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
