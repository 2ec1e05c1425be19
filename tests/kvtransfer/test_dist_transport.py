"""torch.distributed-specific behaviour of the KV transport, what the shared contract
(`test_transport_contract.py`, which runs a gloo pair of processes) does not cover: a handoff bound to the
peer rank whose begin was admitted, the rendezvous store's listening address, the device -> backend
table, and a sender without a process group.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import pytest

from pdcluster.kvtransfer.base import HandoffRefused, new_handoff_secret
from pdcluster.kvtransfer.dist_transport import (
    DistKVReceiver,
    DistKVSender,
    DistTransportConfig,
    rendezvous_store,
)
from pdcluster.kvtransfer.wire import encode_layer, extras_to_dict, meta_to_dict
from tests.kvtransfer.conftest import bits_equal, make_extras, make_handoff, make_layers
from tests.kvtransfer.contract import HANDOFFS, WAIT_S, send_all
from tests.kvtransfer.contract_pairs import RECEIVER_RANK, free_port


def test_data_from_a_rank_not_admitted_to_the_handoff_is_refused_unrecorded():
    """The begin binds the handoff to the peer rank that sent it: a layer, finish or abort for it from
    another rank is dropped (HandoffRefused) and the reservation goes on (no process group needed: the
    receiver's dispatch is called directly, as its receive threads do)."""
    receiver = DistKVReceiver([], DistTransportConfig("gloo", "cpu"))  # no peers: no receive threads
    meta = receiver.expect(make_handoff("bound-to-rank"))
    real, rogue = {"admitted": set()}, {"admitted": set()}

    def dispatch(peer: int, record: dict, payload=None) -> None:
        receiver._dispatch(peer, record, payload, (real if peer == 0 else rogue)["admitted"])

    dispatch(0, {"kind": "begin", "meta": meta_to_dict(meta)})
    layers = make_layers(meta)
    layer = encode_layer(meta, 0, layers[0])
    with pytest.raises(HandoffRefused, match="rank 1, which was not admitted"):
        dispatch(1, {"kind": "layer", "header": layer.header.to_dict()}, layer.payload)
    with pytest.raises(HandoffRefused):
        dispatch(1, {"kind": "abort", "request_id": meta.request_id, "reason": "forged"})
    with pytest.raises(HandoffRefused):
        dispatch(1, {"kind": "begin", "meta": meta_to_dict(meta)})  # the real secret, a second sender
    assert receiver._reservations.failure(meta.request_id) is None
    for layer_idx, latent in enumerate(layers):
        layer = encode_layer(meta, layer_idx, latent)
        dispatch(0, {"kind": "layer", "header": layer.header.to_dict()}, layer.payload)
    dispatch(
        0, {"kind": "finish", "request_id": meta.request_id, "extras": extras_to_dict(make_extras(meta))}
    )
    received = receiver.wait(meta.request_id, WAIT_S)
    assert all(bits_equal(r.latent, x) for r, x in zip(received.layers, layers, strict=True))
    receiver.release(meta.request_id)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on TCP `port` (Linux /proc/net/tcp{,6})."""
    addresses = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                addresses.add(address if width == 32 else socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return addresses


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_rendezvous_store_listens_on_the_given_address_only():
    """torch's own TCPStore listens on every interface whatever `tcp://host` says; ours on host only."""
    port = free_port()
    store = rendezvous_store("127.0.0.1", port, rank=0, world_size=1, timeout_s=WAIT_S)
    store.set("k", b"v")
    assert _listening_addresses(port) == {"127.0.0.1"}
    del store


def test_config_maps_devices_to_backends_and_names_bad_fields():
    assert DistTransportConfig.for_device("cpu") == DistTransportConfig("gloo", "cpu")
    assert DistTransportConfig.for_device("cuda:1") == DistTransportConfig("nccl", "cuda:1")
    assert DistTransportConfig.for_device("npu:0").backend == "hccl"
    with pytest.raises(ValueError, match="device"):
        DistTransportConfig("gloo", "tpu")
    with pytest.raises(ValueError, match="backend"):
        DistTransportConfig("", "cpu")


def test_failed_send_is_forgotten_without_flush():
    """No process group: every send fails. The request is dropped once its finish is processed; only
    the error waits for flush (before the fix the request stayed until flush)."""
    sender = DistKVSender(RECEIVER_RANK, DistTransportConfig("gloo", "cpu"))
    meta = dataclasses.replace(HANDOFFS["bitexact"], secret=new_handoff_secret())
    send_all(sender, meta)
    deadline_s = time.monotonic() + WAIT_S
    while sender.pending_request_ids() and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert sender.pending_request_ids() == []
    failures = sender.flush(WAIT_S)
    assert list(failures) == [meta.request_id]
    assert "failed" in str(failures[meta.request_id])
    assert sender.flush(WAIT_S) == {}
    sender.close(join_timeout_s=1.0)
