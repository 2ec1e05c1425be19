"""Shared-memory segments of the shm transport: anonymous (`memfd_create`), owned by the decode side,
mapped by both, reused across handoffs.

Why anonymous. A segment has no name anywhere (nothing in /dev/shm, nothing to guess, nothing left behind):
the decode receiver creates it with `os.memfd_create` (mode set to 0600), maps it, and hands its file
descriptor to the one prefill sender admitted to the handoff, over the authenticated control socket
(`SCM_RIGHTS`). The kernel frees its memory when the last descriptor and mapping go, so a killed actor on
either side cannot leak it: its mappings die with it, and the survivor unmaps when the channel closes. Where
`memfd_create` does not exist, the segment is a temporary file in /dev/shm (else the temp dir) created with
O_EXCL, mode 0600 and a random name, and unlinked before it is ever used (`tempfile.TemporaryFile`): again
nothing outlives the processes. (It also escapes container /dev/shm size limits: memfd memory is counted
as the process's shared memory, not against the /dev/shm mount.)

Reuse. Mapping a fresh segment per handoff would fault in every page each time (for DeepSeek-V3's 144 MB a
handoff, about 35,000 faults). So each connection keeps a `SegmentPool`: a handoff gets the smallest free
segment that holds it (capacities are powers of two, at least 1 MiB), and returns it when the sender is
done writing; free segments beyond `max_free_bytes` are closed (the sender is told to unmap them).
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
DEFAULT_MAX_FREE_BYTES = 1 << 30  # free segments a connection keeps mapped for reuse
MEMFD_NAME = "pdcluster-kv"  # shown in /proc/<pid>/maps as "/memfd:pdcluster-kv (deleted)"


def segment_capacity(num_bytes: int) -> int:
    """The capacity a segment for `num_bytes` gets: the next power of two, at least `MIN_SEGMENT_BYTES`
    (untouched pages of a mapping cost no memory, so rounding up only costs address space)."""
    return max(MIN_SEGMENT_BYTES, 1 << max(0, num_bytes - 1).bit_length())


def anonymous_fd(num_bytes: int, name: str = MEMFD_NAME, seal_size: bool = False) -> int:
    """A new anonymous shared-memory file of `num_bytes` bytes, mode 0600 (see the module docstring),
    named `name` in /proc/<pid>/maps. seal_size: a memfd's size is then sealed (`F_SEAL_SHRINK`,
    `F_SEAL_GROW`, `F_SEAL_SEAL`): no process it is passed to can truncate it under the others' mappings
    (which would crash them with SIGBUS at their next access)."""
    sealing = seal_size and hasattr(os, "MFD_ALLOW_SEALING") and hasattr(fcntl, "F_ADD_SEALS")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0))
    else:  # unlinked at once: never visible under a name an unrelated process could open
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
    """Whether the memfd `fd` can no longer shrink (`F_SEAL_SHRINK`); None: not a memfd with seals (or
    the platform has none)."""
    if not hasattr(fcntl, "F_GET_SEALS"):
        return None
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return None
    return bool(seals & fcntl.F_SEAL_SHRINK)


class Segment:
    """One mapped segment: `segment_id` (unique per connection), `capacity_bytes`, and its descriptor
    (`fd`, kept by the owner to pass it on; None once passed and closed, e.g. on the sender). A segment
    given a descriptor owns it: the constructor closes it when it raises (ValueError: the file is smaller
    than `capacity_bytes`; OSError: it cannot be mapped).

    `view(offset_bytes, num_bytes)` is a 1-D uint8 tensor sharing the mapping (no copy)."""

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
        """Close the descriptor (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Close the descriptor and unmap. Views still alive keep the mapping until they go (the mmap
        refuses to close under exported buffers; the garbage collector unmaps it then)."""
        self.close_fd()
        self._array = None
        with contextlib.suppress(BufferError):
            self._mmap.close()


class SegmentPool:
    """A connection's segments on the decode side: `acquire` one for a handoff, `give_back` it when the
    sender is done with it, `close` all. Thread-safe."""

    def __init__(self, max_free_bytes: int = DEFAULT_MAX_FREE_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._free: list[Segment] = []  # oldest first
        self._all: dict[int, Segment] = {}

    def acquire(self, num_bytes: int) -> tuple[Segment, bool]:
        """A segment of at least `num_bytes` and whether it is new (its descriptor not yet passed on)."""
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
        """Return `segment` (closed instead when `reuse` is False); returns the ids of the segments this
        closed, which the sender must unmap too."""
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
