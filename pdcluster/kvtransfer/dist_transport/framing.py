"""One message on a (group, peer) pair: three sends, in order (the package docstring gives the layout).

frame   int64 [2] = [FRAME_MAGIC, header_num_bytes]
header  uint8 [header_num_bytes]: msgpack record with a "kind"
payload uint8 [record["header"]["num_bytes"]]   (layer records only)
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

from pdcluster.kvtransfer.base import ProtocolError

FRAME_MAGIC = 0x4B5658_0001  # "KVX" + wire version 1: a desynchronized stream is caught at the next frame


def send_message(
    record: dict[str, Any], payload: torch.Tensor | None, peer_rank: int, group: Any, device: torch.device
) -> None:
    """Send one message to `peer_rank` of `group`: the frame, the msgpack `record` (a "kind" key), then
    `payload` (`[num_bytes]` uint8, layer records only), moved to `device` (the backend's). Blocks until
    the three sends completed; a failed send raises the collective backend's error (RuntimeError)."""
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
    """Receive the next message from `peer_rank` of `group`: `(record, payload)`, payload `[num_bytes]`
    uint8 on `device` for a layer record, else None. Blocks until it arrives.

    Raises:
        ProtocolError: the frame's magic is wrong (the stream is out of sync).
        RuntimeError: the collective backend's receive failed (peer gone, group torn down).
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
