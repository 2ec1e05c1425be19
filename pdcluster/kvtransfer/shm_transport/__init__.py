"""Shared-memory transport: prefill and decode on one host, the KV through shared pages.

Decode's `ShmKVReceiver` owns the memory: per prefill connection, a pool of anonymous shared-memory
segments (`memfd_create`, mode 0600, no name anywhere), reused across handoffs. A handoff admitted by its
secret gets one; its descriptor travels to the prefill sender once, over a Unix socket only the user's own
processes can reach (a 0700 directory, peer uid checked). Prefill's `ShmKVSender.send_layer` copies each
layer into the segment; the worker sends its header (with the CRC-32C of the segment's bytes) on the socket;
decode hands `on_layer` a view of them, which decode copies into its paged blocks, checksumming them as it
copies, and the receiver checks that CRC (without `on_layer`, `wait`'s layers are copied out first and the
copy is verified; an `on_layer` that does not checksum gets verified bytes). So a layer is copied
once on each side (prefill's tensor -> shared pages -> decode's blocks) and checksummed once on each side
(CRC-32C, the CPU's instruction), and no byte of KV goes through a socket. Where a side copies, it copies in
256 KiB chunks and checksums each chunk right after writing it, while it is in cache
(`wire.copy_with_checksum`: the sender's copy into the segment, the receiver's copy out for `wait`); decode's
`on_layer` CRCs each group of about 256 KiB of the segment and then copies it into its blocks from cache
(`kernels.paged_mla.write_prompt_kv(checksum_start=...)`). The sender
(prefill's thread) and the receiver (its connection thread) work on different layers at once.

In place (`inplace.py`, what a deployed decode rank does with a float wire): decode's whole KV cache is one
sealed memfd (`SharedKVCache`), its descriptor goes to each connected sender once, and a handoff's grant
carries the reservation's block table instead of a segment: prefill copies each layer straight into
decode's blocks, CRC-32C'd as it copies, and decode only reads them to check that CRC. One copy instead of
two; decode's receive thread reads instead of copying. The blocks stay reserved until the sender can no
longer write them (its finish, abort or end; its connection closing; its process gone), whatever decode's
lease says. An int8 wire, or a cache that is not shared, goes through a segment as above.

What goes over the socket (msgpack records, `channel.py`):

    prefill -> decode   begin {meta, its secret}, layer {header}, finish {extras + CRC}, abort {reason},
                        end {request} (stopped writing after a failure decode reported)
    decode -> prefill   grant {request, segment id, capacity; the descriptor the first time}, or in place
                        grant {request, block table; the cache's layout and descriptor the first time},
                        done {request, error or none}, drop {segment ids to unmap}

Faults, as with gRPC: a corrupted layer is a ChecksumMismatch naming it, reported back (`done`) so the
sender's `flush` learns it; a stalled sender's handoff times out at its lease on both sides; a sender whose
process dies or `close`s closes the socket and decode fails its open handoffs with SenderLost at once; data
without a reservation or from a sender not admitted is refused and never recorded.

Nothing outlives its processes: the segments are anonymous (the kernel frees them when the last process
mapping them exits), and the socket directory is removed at `close` or, after a kill, by the next
receiver's `sweep_stale_socket_dirs`.

Modules:

    channel.py   the control socket: records and descriptors, who may connect, the stale-directory sweep
    segments.py  `Segment` (memfd + mapping), `SegmentPool` (reuse per connection)
    sender.py    `ShmKVSender` (prefill side)
    receiver.py  `ShmKVReceiver` (decode side)
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
