"""Shared-memory transport: prefill and decode on one host, the KV through shared pages.

Decode's `ShmKVReceiver` owns anonymous memfd segments (one pool per prefill connection) and passes a
handoff's segment descriptor over a Unix socket in a 0700 directory (peer uid checked). The sender copies
each layer into the segment with its CRC-32C and sends only the header; decode's `on_layer` copies from
the segment into its blocks and the receiver checks the CRC. With decode's float cache shared
(`inplace`), the sender writes straight into decode's blocks instead.

Control records (msgpack, `channel`): prefill -> decode begin, layer, finish, abort, end; decode ->
prefill grant (segment or block table, descriptor the first time), done (error or none), drop.
"""

from pdcluster.kvtransfer.shm_transport.channel import sweep_stale_socket_dirs
from pdcluster.kvtransfer.shm_transport.receiver import ShmKVReceiver
from pdcluster.kvtransfer.shm_transport.segments import Segment, SegmentPool, segment_capacity
from pdcluster.kvtransfer.shm_transport.sender import ShmKVSender

__all__ = [
    "Segment",
    "SegmentPool",
    "ShmKVReceiver",
    "ShmKVSender",
    "segment_capacity",
    "sweep_stale_socket_dirs",
]
