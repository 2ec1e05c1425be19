"""One message on a (group, peer) pair: frame, msgpack header, optional payload.

frame: [2] int64 = [FRAME_MAGIC, header_num_bytes]
header: [header_num_bytes] uint8, a msgpack record with a "kind"
payload: [record["header"]["num_bytes"]] uint8 (layer records only)
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

from pdcluster.kvtransfer.base import ProtocolError

FRAME_MAGIC = 0x4B5658_0001  # "KVX" + wire version 1


def send_message(
    record: dict[str, Any], payload: torch.Tensor | None, peer_rank: int, group: Any, device: torch.device
) -> None:
    """Send one message to `peer_rank`; blocks until sent; the backend's RuntimeError on failure."""
    header = msgpack.packb(record, use_bin_type=True)
    header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    frame = torch.tensor([FRAME_MAGIC, header_t.numel()], dtype=torch.int64, device=device)
    works = [dist.isend(frame, dst=peer_rank, group=group), dist.isend(header_t, dst=peer_rank, group=group)]
    if payload is not None:
        works.append(dist.isend(payload.to(device), dst=peer_rank, group=group))
    for work in works:
        work.wait()


def recv_message(
    peer_rank: int, group: Any, device: torch.device
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The next `(record, payload)` from `peer_rank`; payload is None except for layer records.

    Raises ProtocolError on a wrong magic, the backend's RuntimeError when the receive fails.
    """
    frame = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(frame, src=peer_rank, group=group)
    magic, header_num_bytes = frame.tolist()
    if magic != FRAME_MAGIC:
        raise ProtocolError(f"rank {peer_rank}: bad frame magic {magic:#x}; the stream is out of sync")
    header_t = torch.empty(header_num_bytes, dtype=torch.uint8, device=device)
    dist.recv(header_t, src=peer_rank, group=group)
    record = msgpack.unpackb(header_t.cpu().numpy().tobytes(), raw=False)
    payload = None
    if record["kind"] == "layer":
        payload = torch.empty(record["header"]["num_bytes"], dtype=torch.uint8, device=device)
        dist.recv(payload, src=peer_rank, group=group)
    return record, payload
