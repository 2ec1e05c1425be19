"""The shm transport's control channel: msgpack records over a Unix SOCK_SEQPACKET socket.

A record is packets of at most `MAX_PACKET_BYTES` + 1 bytes: a flag (`b"M"` more follow, `b"E"` last)
and a slice of the msgpack bytes; descriptors (`SCM_RIGHTS`) ride on the first packet. The socket lives
in a fresh 0700 directory `pdcluster-kv-<pid>-<random>`; `sweep_stale_socket_dirs` removes those of
dead processes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import select
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

from pdcluster.kvtransfer.base import ProtocolError

MAX_PACKET_BYTES = 64 << 10  # msgpack bytes per packet (a packet must fit the socket's send buffer)
MAX_RECORD_BYTES = 16 << 20
MAX_FDS_PER_RECORD = 4
SOCKET_DIR_PREFIX = "pdcluster-kv-"
SOCKET_NAME = "kv.sock"
_STALE_DIR = re.compile(rf"^{re.escape(SOCKET_DIR_PREFIX)}(\d+)-")


class Channel:
    """One end of a connection: `send` a record (optionally with descriptors), `recv` the next one."""

    def __init__(self, sock: socket.socket, max_fds: int = MAX_FDS_PER_RECORD) -> None:
        """max_fds: descriptors a record may bring on its first packet; 0 for a side that receives none."""
        self.sock = sock
        self.max_fds = max_fds
        self._write_lock = threading.Lock()

    def send(self, record: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send `record` with `fds` on its first packet; OSError if the peer is gone."""
        data = memoryview(msgpack.packb(record, use_bin_type=True))
        num_packets = max(1, -(-len(data) // MAX_PACKET_BYTES))
        with self._write_lock:
            for i in range(num_packets):
                flag = b"E" if i == num_packets - 1 else b"M"
                packet = flag + data[i * MAX_PACKET_BYTES : (i + 1) * MAX_PACKET_BYTES]
                if i == 0 and fds:
                    sent = socket.send_fds(self.sock, [packet], list(fds))
                else:
                    sent = self.sock.send(packet)
                if sent != len(packet):
                    raise OSError(f"short send on the kv channel: {sent} of {len(packet)} B")

    def try_send(self, record: dict[str, Any]) -> bool:
        """Send a one-packet `record` if the socket takes it now; False when full or another writer holds it.

        Raises OSError if the peer is gone, ValueError for a record over one packet.
        """
        packet = single_packet(record)
        if packet is None:
            raise ValueError("try_send: the record is more than one packet")
        if not self._write_lock.acquire(blocking=False):
            return False
        try:
            self.sock.send(packet, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        finally:
            self._write_lock.release()
        return True

    def recv(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next record and its descriptors; None when the peer closed.

        Raises ProtocolError for a malformed packet or record, OSError when the socket failed.
        """
        parts: list[bytes] = []
        fds: list[int] = []
        try:
            while True:
                packet, got_fds, msg_flags, _ = socket.recv_fds(self.sock, MAX_PACKET_BYTES + 1, self.max_fds)
                if got_fds and parts:
                    fds.extend(got_fds)
                    raise ProtocolError("kv channel: descriptors on a record's later packet")
                fds.extend(got_fds)
                if msg_flags & socket.MSG_CTRUNC:
                    raise ProtocolError(f"kv channel: a packet with more than {self.max_fds} descriptors")
                if not packet:
                    close_fds(fds)
                    return None
                flag, body = packet[:1], packet[1:]
                if flag not in (b"M", b"E"):
                    raise ProtocolError(f"kv channel: bad packet flag {flag!r}")
                parts.append(body)
                if flag == b"E":
                    return record_from_bytes(b"".join(parts)), fds
                if len(parts) * MAX_PACKET_BYTES > MAX_RECORD_BYTES:
                    raise ProtocolError(f"kv channel: a record over {MAX_RECORD_BYTES} B")
        except BaseException:
            close_fds(fds)
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class LogThrottle:
    """Logs a repeated event at its first occurrence, then at most once per `interval_s` with a count."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._count = 0
        self._logged_at_s = -math.inf
        self._lock = threading.Lock()

    def count(self) -> int | None:
        """Count one occurrence; the count to log when a line is due, else None."""
        with self._lock:
            self._count += 1
            now_s = time.monotonic()
            if now_s - self._logged_at_s < self.interval_s:
                return None
            count, self._count, self._logged_at_s = self._count, 0, now_s
            return count

    def warning(self, logger: logging.Logger, message: str, *args: Any) -> None:
        """Count one occurrence and log `message` (starting with `%d` for the count) when due."""
        count = self.count()
        if count is not None:
            logger.warning(message, count, *args)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` is readable (or closed) within `timeout_s`; `poll`, so any descriptor number works."""
    if sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def record_from_bytes(data: bytes) -> dict[str, Any]:
    """Decode msgpack `data`; ProtocolError unless it is a mapping with a kind (`k`)."""
    try:
        record = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"kv channel: malformed record: {e}") from None
    if not isinstance(record, dict) or "k" not in record:
        raise ProtocolError(f"kv channel: a record must be a mapping with a kind, got {record!r:.80}")
    return record


def single_packet(record: dict[str, Any]) -> bytes | None:
    """`record` framed as one packet, or None when it needs more."""
    data = msgpack.packb(record, use_bin_type=True)
    return b"E" + data if len(data) <= MAX_PACKET_BYTES else None


def record_from_single_packet(packet: bytes) -> dict[str, Any]:
    """The record of a one-packet record; ProtocolError for anything else."""
    if packet[:1] != b"E":
        raise ProtocolError(f"kv channel: expected a one-packet record, got flag {packet[:1]!r}")
    return record_from_bytes(packet[1:])


def connect(path: str) -> Channel:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return Channel(sock)


def listen(backlog: int = 64) -> tuple[socket.socket, Path]:
    directory = Path(tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-"))  # mode 0700
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(str(directory / SOCKET_NAME))
        sock.listen(backlog)
    except OSError:
        sock.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return sock, directory


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """The connected peer's `(pid, uid)` (Linux `SO_PEERCRED`); None where the platform does not say."""
    if not sys.platform.startswith("linux"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def peer_uid(sock: socket.socket) -> int | None:
    creds = peer_credentials(sock)
    return None if creds is None else creds[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_gone(pid: int) -> bool:
    """True when process `pid` does not exist or is a zombie; False for pid <= 0."""
    if pid <= 0:
        return False
    if not _pid_alive(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return not _pid_alive(pid)
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")


def sweep_stale_socket_dirs(temp_dir: str | None = None) -> list[str]:
    """Remove this user's socket directories whose process is gone; returns the removed paths."""
    root = Path(temp_dir or tempfile.gettempdir())
    removed = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            match = _STALE_DIR.match(entry.name)
            if match is None or _pid_alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir() and entry.stat().st_uid == os.getuid():
                    shutil.rmtree(entry)
                    removed.append(str(entry))
    return removed
