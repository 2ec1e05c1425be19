"""The transports' pairs for the contract scenarios (`tests/kvtransfer/contract.py`): the gRPC roles and
the shared-memory roles as two threads of the test process (`run_grpc_pair`, `run_shm_pair`; the shm
segments' descriptors still travel over the Unix socket), the torch.distributed roles as rank 0 and rank 1
of a gloo group of two spawned processes (`run_dist_pair`, records back as JSON); each with its rogue
sender (`Transport.forge` / `Transport.replay_begin`) made with the transport's own means."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
import traceback
from pathlib import Path

import torch

from pdcluster.kvtransfer.ports import free_ports
from tests.kvtransfer.conftest import make_layers
from tests.kvtransfer.contract import (
    EVENT_NAMES,
    WAIT_S,
    Transport,
    flushed,
    forged_extras,
    make_fault_hook,
    run_receiver,
    run_sender,
    send_all,
)

# ---- gRPC: two threads ----


def forged_messages(meta) -> list:
    """Begin + one layer of junk + Finish carrying a forged first token, as protobuf messages."""
    from pdcluster.kvtransfer.grpc_transport import extras_to_proto, header_to_proto, meta_to_proto
    from pdcluster.kvtransfer.wire import encode_layer
    from pdcluster.protos import kv_transfer_pb2 as pb

    layer = encode_layer(meta, 0, make_layers(meta, seed=99)[0])
    chunk = pb.LayerChunk(layer_idx=0, offset_bytes=0, data=layer.payload.numpy().tobytes())
    chunk.header.CopyFrom(header_to_proto(layer.header))
    return [
        pb.KVMessage(begin=meta_to_proto(meta)),
        pb.KVMessage(chunk=chunk),
        pb.KVMessage(finish=extras_to_proto(forged_extras(meta))),
    ]


def raw_call(address: str, requests, metadata=None, timeout_s=None):
    """A `Transfer` call made with the bare generated stub (what a process that is not our sender can do)."""
    import grpc

    from pdcluster.protos import kv_transfer_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    future = pb_grpc.KVTransferStub(channel).Transfer.future(requests, metadata=metadata, timeout=timeout_s)
    future.add_done_callback(lambda _: channel.close())
    return future


class AddressedTransport(Transport):
    """A transport whose senders connect to the receiver's `address`: a rogue sender is another one of
    ours (`new_sender`) with a forged or replayed handoff; `replay_begin` is such a whole handoff."""

    def __init__(self, address: str) -> None:
        super().__init__()
        self.address = address

    def new_sender(self):
        raise NotImplementedError

    def _rogue(self, meta, secret: bytes) -> None:
        rogue = self.new_sender()
        forged = dataclasses.replace(meta, secret=secret)
        send_all(rogue, forged, make_layers(meta, seed=99), forged_extras(meta))
        self.rogue_failures += flushed(rogue).values()
        rogue.close()

    def replay_begin(self, meta, secret: bytes) -> None:
        self._rogue(meta, secret)


class GrpcTransport(AddressedTransport):
    name = "grpc"

    def new_sender(self):
        from pdcluster.kvtransfer.grpc_transport import GrpcKVSender

        return GrpcKVSender(self.address)

    def forge(self, meta, secret: bytes | None) -> None:
        if secret:
            self._rogue(meta, secret)
            return
        # Our sender refuses to begin without a secret: a bare stub call, without or with an empty one.
        from pdcluster.kvtransfer.grpc_transport import HANDOFF_ID_KEY, HANDOFF_SECRET_KEY

        metadata = [(HANDOFF_ID_KEY, meta.request_id)]
        if secret is not None:
            metadata.append((HANDOFF_SECRET_KEY, secret))
        error = raw_call(self.address, iter(forged_messages(meta)), metadata).exception(timeout=WAIT_S)
        self.rogue_failures.append(f"{error.code().name}: {error.details()}" if error else "accepted")


def run_thread_pair(transport: Transport, server, sender) -> dict[str, dict]:
    """The sender and receiver roles as two threads of this process."""
    sync, secrets = threading.Barrier(2, timeout=60), queue.Queue()
    events = {name: threading.Event() for name in EVENT_NAMES}
    results: dict[str, dict] = {"sender": {}, "receiver": {}}

    def role(name: str, fn, *args) -> None:
        try:
            fn(*args, sync, events, secrets, results[name])
        except BaseException:
            results[name]["traceback"] = traceback.format_exc()
            sync.abort()

    threads = [
        threading.Thread(target=role, args=("sender", run_sender, transport, sender)),
        threading.Thread(target=role, args=("receiver", run_receiver, server)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def run_grpc_pair() -> dict[str, dict]:
    from pdcluster.kvtransfer.grpc_transport import GrpcKVSender, KVReceiverServer

    server = KVReceiverServer("127.0.0.1", 0, int8_passthrough=False)
    sender = GrpcKVSender(server.address, max_chunk_bytes=1000, fault_hook=make_fault_hook())
    results = run_thread_pair(GrpcTransport(server.address), server, sender)
    results["receiver"]["num_refused_streams"] = server.num_refused_streams
    server.close(grace_s=0)
    return results


# ---- shared memory: two threads ----


class ShmTransport(AddressedTransport):
    name = "shm"

    def new_sender(self):
        from pdcluster.kvtransfer.shm_transport import ShmKVSender

        return ShmKVSender(self.address)

    def forge(self, meta, secret: bytes | None) -> None:
        if secret:
            self._rogue(meta, secret)
            return
        # Our sender refuses to begin without a secret: bare records on a connection of its own.
        from pdcluster.kvtransfer.shm_transport.channel import connect
        from pdcluster.kvtransfer.wire import encode_layer, extras_to_dict, meta_to_dict

        record = meta_to_dict(dataclasses.replace(meta, secret=secret or b""))
        if secret is None:
            del record["secret"]
        channel = connect(self.address)
        layer = encode_layer(meta, 0, make_layers(meta, seed=99)[0])
        channel.send({"k": "begin", "meta": record})
        channel.send({"k": "layer", "h": layer.header.to_dict()})
        channel.send({"k": "finish", "rid": meta.request_id, "x": extras_to_dict(forged_extras(meta))})
        got = channel.recv()  # the refusal: done with [error class, message]
        self.rogue_failures.append(": ".join(got[0]["error"]) if got else "closed")
        channel.close()


def run_shm_pair() -> dict[str, dict]:
    from pdcluster.kvtransfer.shm_transport import ShmKVReceiver, ShmKVSender

    receiver = ShmKVReceiver(int8_passthrough=False)
    sender = ShmKVSender(receiver.address, fault_hook=make_fault_hook())
    results = run_thread_pair(ShmTransport(receiver.address), receiver, sender)
    deadline_s = time.monotonic() + WAIT_S  # the closed senders' connections end within a poll or two
    while receiver.num_segments and time.monotonic() < deadline_s:
        time.sleep(0.01)
    results["receiver"]["num_segments_after_close"] = receiver.num_segments
    receiver.close()
    return results


# ---- shm+grpc: a decode rank's two listeners over one set of reservations ----


def run_paired_pair(kind: str) -> dict[str, dict]:
    """`kvtransfer.paired.PairedReceiver` with a sender of `kind` (`shm`: on its node, `grpc`: elsewhere)
    at the matching address; the other listener idles beside it on the same reservations."""
    from pdcluster.kvtransfer.grpc_transport import GrpcKVSender
    from pdcluster.kvtransfer.paired import PairedReceiver
    from pdcluster.kvtransfer.shm_transport import ShmKVSender

    receiver = PairedReceiver("127.0.0.1")
    address = receiver.address
    if kind == "shm":
        transport: AddressedTransport = ShmTransport(address.shm)
        sender = ShmKVSender(address.shm, fault_hook=make_fault_hook())
    else:
        transport = GrpcTransport(address.grpc)
        sender = GrpcKVSender(address.grpc, max_chunk_bytes=1000, fault_hook=make_fault_hook())
    results = run_thread_pair(transport, receiver, sender)
    results["receiver"]["num_refused_streams"] = receiver.grpc.num_refused_streams
    deadline_s = time.monotonic() + WAIT_S
    while receiver.num_segments and time.monotonic() < deadline_s:
        time.sleep(0.01)
    results["receiver"]["num_segments_after_close"] = receiver.num_segments
    receiver.close()
    return results


# ---- torch.distributed: two processes ----

SENDER_RANK, RECEIVER_RANK = 0, 1


class DistTransport(Transport):
    name = "dist"

    @staticmethod
    def _send_raw(record: dict, payload=None) -> None:
        from pdcluster.kvtransfer.dist_transport import send_message

        send_message(record, payload, RECEIVER_RANK, None, torch.device("cpu"))

    def forge(self, meta, secret: bytes | None) -> None:
        from pdcluster.kvtransfer.wire import encode_layer, extras_to_dict, meta_to_dict

        record = meta_to_dict(dataclasses.replace(meta, secret=secret or b""))
        if secret is None:
            del record["secret"]
        self._send_raw({"kind": "begin", "meta": record})
        layer = encode_layer(meta, 0, make_layers(meta, seed=99)[0])
        self._send_raw({"kind": "layer", "header": layer.header.to_dict()}, layer.payload)
        extras = extras_to_dict(forged_extras(meta))
        self._send_raw({"kind": "finish", "request_id": meta.request_id, "extras": extras})

    def replay_begin(self, meta, secret: bytes) -> None:
        from pdcluster.kvtransfer.wire import meta_to_dict

        self._send_raw({"kind": "begin", "meta": meta_to_dict(dataclasses.replace(meta, secret=secret))})


def free_port() -> int:
    return free_ports("127.0.0.1", 1)[0]


def _dist_rank(rank: int, port: int, result_dir: str, sync, events, secrets) -> None:
    import torch.distributed as dist

    from pdcluster.kvtransfer.dist_transport import (
        DistKVReceiver,
        DistKVSender,
        DistTransportConfig,
        init_transport_group,
    )

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    config = DistTransportConfig("gloo", "cpu")
    init_transport_group(config, rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=60)
    out: dict = {}
    try:
        if rank == SENDER_RANK:
            sender = DistKVSender(RECEIVER_RANK, config, fault_hook=make_fault_hook())
            run_sender(DistTransport(), sender, sync, events, secrets, out)
        else:
            receiver = DistKVReceiver([SENDER_RANK], config)
            run_receiver(receiver, sync, events, secrets, out)
            receiver.close()
    except BaseException:
        out["traceback"] = traceback.format_exc()
        sync.abort()  # wake the other rank instead of letting it hang on the barrier
        raise
    finally:
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def run_dist_pair(result_dir: Path) -> dict[str, dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    sync, secrets = ctx.Barrier(2, timeout=60), ctx.Queue()
    events = {name: ctx.Event() for name in EVENT_NAMES}
    try:
        mp.spawn(_dist_rank, args=(free_port(), str(result_dir), sync, events, secrets), nprocs=2, join=True)
    finally:
        for rank in (SENDER_RANK, RECEIVER_RANK):
            path = result_dir / f"rank{rank}.json"
            if path.exists() and "traceback" in json.loads(path.read_text()):
                print(f"rank {rank}:\n{json.loads(path.read_text())['traceback']}")
    return {
        "sender": json.loads((result_dir / f"rank{SENDER_RANK}.json").read_text()),
        "receiver": json.loads((result_dir / f"rank{RECEIVER_RANK}.json").read_text()),
    }
