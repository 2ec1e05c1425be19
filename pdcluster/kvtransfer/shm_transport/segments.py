"""Anonymous shared-memory segments of the shm transport, owned by decode, reused per connection.

A segment is a `memfd_create` file (mode 0600) or, where that is missing, an unlinked temporary file, so
nothing outlives the processes. Each connection's `SegmentPool` reuses segments to avoid page faults.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import tempfile
import threading

import numpy as np
import torch

MIN_SEGMENT_BYTES = 1 << 20
DEFAULT_MAX_FREE_BYTES = 1 << 30
MEMFD_NAME = "pdcluster-kv"


def segment_capacity(num_bytes: int) -> int:
    """The next power of two of `num_bytes`, at least `MIN_SEGMENT_BYTES`."""
    return max(MIN_SEGMENT_BYTES, 1 << max(0, num_bytes - 1).bit_length())


def anonymous_fd(num_bytes: int, name: str = MEMFD_NAME, seal_size: bool = False) -> int:
    """A new anonymous shared file of `num_bytes` bytes, mode 0600.

    seal_size: seal a memfd's size so no process can truncate it under the others' mappings (SIGBUS).
    """
    sealing = seal_size and hasattr(os, "MFD_ALLOW_SEALING") and hasattr(fcntl, "F_ADD_SEALS")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0))
    else:
        sealing = False
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryFile(dir=shm_dir) as f:
            fd = os.dup(f.fileno())
    try:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o600)
        os.ftruncate(fd, num_bytes)
        if sealing:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def size_is_sealed(fd: int) -> bool | None:
    """Whether memfd `fd` can no longer shrink; None for no seals (not a memfd or no platform support)."""
    if not hasattr(fcntl, "F_GET_SEALS"):
        return None
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return None
    return bool(seals & fcntl.F_SEAL_SHRINK)


class Segment:
    """One mapped segment; `view(offset_bytes, num_bytes)` is a [num_bytes] uint8 tensor on the mapping.

    Owns a given `fd`, closing it when the constructor raises (ValueError: file too small; OSError: no map).
    """

    def __init__(self, segment_id: int, capacity_bytes: int, fd: int | None = None) -> None:
        self.segment_id = segment_id
        self.capacity_bytes = capacity_bytes
        self.fd = anonymous_fd(capacity_bytes) if fd is None else fd
        try:
            size = os.fstat(self.fd).st_size
            if size < capacity_bytes:  # a mapping past the end of the file faults (SIGBUS) when written
                raise ValueError(
                    f"segment {segment_id}: its file has {size} B, fewer than the {capacity_bytes} B granted"
                )
            self._mmap = mmap.mmap(self.fd, capacity_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)

    def view(self, offset_bytes: int, num_bytes: int) -> torch.Tensor:
        if not (0 <= offset_bytes and offset_bytes + num_bytes <= self.capacity_bytes):
            raise ValueError(
                f"segment {self.segment_id}: [{offset_bytes}, {offset_bytes + num_bytes}) is outside its "
                f"{self.capacity_bytes} B"
            )
        return torch.from_numpy(self._array[offset_bytes : offset_bytes + num_bytes])

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Close the descriptor and unmap (live views keep the mapping until collected)."""
        self.close_fd()
        self._array = None
        with contextlib.suppress(BufferError):
            self._mmap.close()


class SegmentPool:
    """A connection's segments on the decode side. Thread-safe."""

    def __init__(self, max_free_bytes: int = DEFAULT_MAX_FREE_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._free: list[Segment] = []
        self._all: dict[int, Segment] = {}

    def acquire(self, num_bytes: int) -> tuple[Segment, bool]:
        """A segment of at least `num_bytes` and whether it is new (descriptor not yet passed)."""
        with self._lock:
            fits = [s for s in self._free if s.capacity_bytes >= num_bytes]
            if fits:
                segment = min(fits, key=lambda s: s.capacity_bytes)
                self._free.remove(segment)
                return segment, False
            segment = Segment(next(self._ids), segment_capacity(num_bytes))
            self._all[segment.segment_id] = segment
            return segment, True

    def give_back(self, segment: Segment, reuse: bool = True) -> list[int]:
        """Return `segment` (closed if not `reuse`); returns the ids closed, which the sender must unmap."""
        with self._lock:
            if segment.segment_id not in self._all:
                return []
            self._free.append(segment)
            if not reuse:
                return self._close_locked([segment])
            num_free_bytes = sum(s.capacity_bytes for s in self._free)
            evicted = []
            while self._free and num_free_bytes > self.max_free_bytes:
                oldest = self._free[0]
                num_free_bytes -= oldest.capacity_bytes
                evicted.append(oldest)
            return self._close_locked(evicted)

    def _close_locked(self, segments: list[Segment]) -> list[int]:
        for segment in segments:
            self._free.remove(segment)
            del self._all[segment.segment_id]
            segment.close()
        return [s.segment_id for s in segments]

    @property
    def num_segments(self) -> int:
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        with self._lock:
            segments, self._all, self._free = list(self._all.values()), {}, []
        for segment in segments:
            segment.close()
