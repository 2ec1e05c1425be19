"""`kv_transfer.transport: auto` on two nodes resolves per pair of ranks (`shm+grpc`, `kvtransfer.paired`):
shared memory between the prefill and the decode on one node, gRPC to the decode on the other.

Run by `make test-netns` (tests/netns/run_two_node.sh, as root) before test_two_node.py, in the same two
namespaces: node 0 (pdc-a, 10.200.0.1, the Ray head with 2 CPUs) and node 1 (pdc-b, 10.200.0.2, 1 CPU),
joined by one veth pair; elsewhere skipped. The topology is clusters/netns-2node.yaml with two devices per
node, two decode instances, `transport: auto` and round-robin routing: the plan puts prefill-0 and
decode-0 on node 0 and decode-1 on node 1 (pinned by the `pdcluster_node_<i>` resources).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from pdcluster.config import load_topology
from tests.cluster.conftest import assert_nothing_held, deployed_with_loop
from tests.netns.test_two_node import (
    IP_A,
    IP_B,
    NS_A,
    SHORT_PROMPT,
    TOPOLOGY,
    VETH_A,
    generate,
    long_prompt,
    oracle,  # noqa: F401 - a fixture
    restore_link,
    tx_bytes,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("PDCLUSTER_NETNS") != "1",
        reason="two-node network-namespace test: run `make test-netns` (root; tests/netns/run_two_node.sh)",
    ),
]


@pytest.fixture(scope="module")
def cluster():
    assert os.environ.get("RAY_ADDRESS"), "run_two_node.sh sets RAY_ADDRESS to the head in pdc-a"
    restore_link()
    topology = load_topology(TOPOLOGY)
    topology = dataclasses.replace(
        topology,
        name="netns-2node-auto",
        hardware=dataclasses.replace(topology.hardware, devices_per_node=2),
        decode=dataclasses.replace(topology.decode, num_instances=2, compile=False),
        kv_transfer=dataclasses.replace(topology.kv_transfer, transport="auto"),
        router=dataclasses.replace(topology.router, policy="round_robin"),
    )
    assert topology.kv_transport == "shm+grpc"
    with deployed_with_loop(topology, log=lambda line: print(f"deploy: {line}", flush=True)) as cluster:
        yield cluster


def test_auto_takes_shm_on_the_node_and_grpc_across_it(cluster, oracle) -> None:  # noqa: F811
    """prefill-0's sender to decode-0 (its node) is shm and to decode-1 (the other node) gRPC at pdc-b's
    address; requests routed to each decode in turn give one in-process engine's greedy tokens; the KV of
    decode-1's requests crosses the veth, decode-0's does not (pdc-a's end sends less than one handoff's
    KV while it runs) and only decode-0 mapped shared memory; nothing is held afterwards."""
    import ray

    bound_s = cluster.call_timeout_s
    transports = ray.get(cluster.prefill_actors[0].sender_transports.remote(), timeout=bound_s)
    decode_ips = ray.get([d.node_ip.remote() for d in cluster.decode_actors], timeout=bound_s)
    addresses = cluster._decode_addresses
    print(f"NETNS: auto transports = {transports}, decode ips = {decode_ips}", flush=True)
    assert transports == [["shm"], ["grpc"]]
    assert decode_ips == [IP_A, IP_B]
    assert addresses[1][0].grpc.startswith(f"{IP_B}:") and addresses[0][0].shm.startswith("/")

    results = {}
    for i, ids in enumerate(
        [cluster.tokenizer.encode(SHORT_PROMPT)] * 2 + [long_prompt(cluster, 1), long_prompt(cluster, 2)]
    ):
        sent_before = tx_bytes(NS_A, VETH_A)
        tokens, phases = generate(cluster, f"auto-{i}", ids)
        sent = tx_bytes(NS_A, VETH_A) - sent_before
        assert tokens == oracle(ids)
        results[f"auto-{i}"] = {"kv_bytes": phases["kv_transfer_bytes"], "link_bytes_a_to_b": sent}
    print("NETNS: auto = " + json.dumps(results), flush=True)
    # round robin: requests 0 and 2 went to decode-0 (same node), 1 and 3 to decode-1 (across the link)
    long_same, long_across = results["auto-2"], results["auto-3"]
    assert long_across["link_bytes_a_to_b"] >= long_across["kv_bytes"] > 0
    assert long_same["link_bytes_a_to_b"] < long_same["kv_bytes"]
    in_place = ray.get([d.kv_in_place_stats.remote() for d in cluster.decode_actors], timeout=bound_s)
    assert in_place[0]["granted"] > 0 and in_place[1]["granted"] == 0, in_place  # shm only on one node
    assert_nothing_held(cluster)
