"""The control channel of the shared-memory transport: msgpack records over a Unix SOCK_SEQPACKET socket,
with file descriptors (the KV segments) passed alongside (`SCM_RIGHTS`).

A record is one or more packets of at most `MAX_PACKET_BYTES` + 1 bytes: a one-byte flag (`b"M"`: more
packets follow, `b"E"`: the record's last packet) and a slice of the msgpack bytes. A sequenced-packet
socket keeps packet boundaries and delivers the descriptors with the packet they were sent with, so no
framing of our own can go out of step. Writers hold the channel's lock for a whole record.

Who may connect. The receiver's socket lives in a fresh directory of mode 0700 (`tempfile.mkdtemp`), so
only processes of the receiver's user can reach it; on Linux the receiver also checks the connecting
process's uid (`SO_PEERCRED`). That is the same boundary as every other file of the user's; each handoff is
then still bound to its reservation by the handoff's secret (`Reservations.claim`).

Leftovers. The directory is named `pdcluster-kv-<pid>-<random>` after the receiver's process, and removed at
`close`. A receiver killed before `close` leaves the directory (a socket file, no memory: the KV segments
are anonymous, see `segments.py`); `sweep_stale_socket_dirs`, run by every new receiver, removes those of
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
# A record's msgpack bytes at most: the largest real one is a finish with its draft probabilities
# (num_drafts x vocab_size float32: 4.1 MB for DeepSeek-V3's 129,280 tokens at 8 drafts); a peer that sends
# more is cut off rather than buffered.
MAX_RECORD_BYTES = 16 << 20
MAX_FDS_PER_RECORD = 4
SOCKET_DIR_PREFIX = "pdcluster-kv-"
SOCKET_NAME = "kv.sock"
_STALE_DIR = re.compile(rf"^{re.escape(SOCKET_DIR_PREFIX)}(\d+)-")


class Channel:
    """One end of a connection: `send` a record (optionally with descriptors), `recv` the next one."""

    def __init__(self, sock: socket.socket, max_fds: int = MAX_FDS_PER_RECORD) -> None:
        """max_fds: descriptors a record may bring, all on its first packet; a peer that sends more (or any
        on a later packet) is cut off, and the kernel closes what did not fit. 0 for a side that never
        receives descriptors (decode's receiver): none ever reach this process."""
        self.sock = sock
        self.max_fds = max_fds
        self._write_lock = threading.Lock()

    def send(self, record: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send `record` (msgpack-able), with `fds` attached to its first packet. OSError if the peer is
        gone."""
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
                if sent != len(packet):  # a sequenced packet goes whole or not at all
                    raise OSError(f"short send on the kv channel: {sent} of {len(packet)} B")

    def try_send(self, record: dict[str, Any]) -> bool:
        """Send `record` (one packet's worth) if the socket takes it now; False when its buffer is full (the
        peer is behind) or when another writer holds the channel. OSError if the peer is gone; ValueError
        for a record over one packet."""
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
        """The next record and the descriptors that came with it; None when the peer closed.

        Raises:
            ProtocolError: a malformed packet or record (the caller drops the connection).
            OSError: the socket failed.
        """
        parts: list[bytes] = []
        fds: list[int] = []
        try:
            while True:
                packet, got_fds, msg_flags, _ = socket.recv_fds(self.sock, MAX_PACKET_BYTES + 1, self.max_fds)
                if got_fds and parts:  # held back until the record ends, they could pile up without bound
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
        except BaseException:  # malformed, or the socket failed: nothing received is kept
            close_fds(fds)
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class LogThrottle:
    """Says when to log one kind of repeated event (a refused connection, a malformed record): at its first
    occurrence, then at most once per `interval_s`, with how many occurred since the last line, so that a
    local process looping on bad input cannot flood the log. Thread-safe."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._count = 0
        self._logged_at_s = -math.inf
        self._lock = threading.Lock()

    def count(self) -> int | None:
        """Count one occurrence; the number to log (those since the last line, this one included) when a
        line is due, else None."""
        with self._lock:
            self._count += 1
            now_s = time.monotonic()
            if now_s - self._logged_at_s < self.interval_s:
                return None
            count, self._count, self._logged_at_s = self._count, 0, now_s
            return count

    def warning(self, logger: logging.Logger, message: str, *args: Any) -> None:
        """Count one occurrence and, when a line is due, log `message` at WARNING with the count as its
        first argument (`message` starts with a `%d` for it), then `args`."""
        count = self.count()
        if count is not None:
            logger.warning(message, count, *args)


def close_fds(fds: list[int]) -> None:
    """Close every descriptor of `fds`, ignoring those already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` has something to read (or is closed) within `timeout_s`. `poll`, not `select`:
    any descriptor number works (select() refuses those of 1024 and more)."""
    if sock.fileno() < 0:  # closed here: readable, so that the caller's recv fails and it stops
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def record_from_bytes(data: bytes) -> dict[str, Any]:
    """The record whose msgpack bytes are `data`. ProtocolError unless it is a mapping with a kind (`k`)."""
    try:
        record = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"kv channel: malformed record: {e}") from None
    if not isinstance(record, dict) or "k" not in record:
        raise ProtocolError(f"kv channel: a record must be a mapping with a kind, got {record!r:.80}")
    return record


def single_packet(record: dict[str, Any]) -> bytes | None:
    """`record` framed as one packet (flag `E`), for a sender that must not block mid-record; None when it
    needs more than one (over `MAX_PACKET_BYTES`)."""
    data = msgpack.packb(record, use_bin_type=True)
    return b"E" + data if len(data) <= MAX_PACKET_BYTES else None


def record_from_single_packet(packet: bytes) -> dict[str, Any]:
    """The record of a one-packet record (`single_packet`). ProtocolError for any other packet, the first
    of a longer record included, or a malformed record."""
    if packet[:1] != b"E":
        raise ProtocolError(f"kv channel: expected a one-packet record, got flag {packet[:1]!r}")
    return record_from_bytes(packet[1:])


def connect(path: str) -> Channel:
    """Connect to a receiver's socket at `path`. OSError (FileNotFoundError, ConnectionRefusedError)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return Channel(sock)


def listen(backlog: int = 64) -> tuple[socket.socket, Path]:
    """A listening socket in a fresh 0700 directory `pdcluster-kv-<pid>-<random>` under the temp dir."""
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
    """The connected peer process's `(pid, uid)` (Linux `SO_PEERCRED`); None where the platform does not
    say."""
    if not sys.platform.startswith("linux"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def peer_uid(sock: socket.socket) -> int | None:
    """The connected peer process's uid (Linux `SO_PEERCRED`); None where the platform does not say."""
    creds = peer_credentials(sock)
    return None if creds is None else creds[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def process_gone(pid: int) -> bool:
    """True when process `pid` no longer runs: it does not exist, or it is a zombie (dead, not yet reaped:
    it can touch no memory). False for an unknown pid (<= 0)."""
    if pid <= 0:
        return False
    if not _pid_alive(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no /proc, or the process went meanwhile
        return not _pid_alive(pid)
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")


def sweep_stale_socket_dirs(temp_dir: str | None = None) -> list[str]:
    """Remove this user's `pdcluster-kv-<pid>-*` socket directories whose process is gone (receivers
    killed before `close`); returns the removed paths. A live process's directory is never touched."""
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
