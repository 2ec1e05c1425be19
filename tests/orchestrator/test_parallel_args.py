"""Each rank's `EngineConfig.parallel` as the deployment derives it from the topology
(`config.engine_args.parallel_config`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pdcluster.config import load_topology
from pdcluster.engine.parallel import ParallelConfig

CLUSTERS = Path(__file__).resolve().parents[2] / "clusters"


def test_experts_split_over_every_rank_give_each_rank_its_ep_layout() -> None:
    topo = load_topology(CLUSTERS / "local-ep.yaml")
    for role in ("prefill", "decode"):
        for rank in (0, 1):
            assert topo.engine_config(role, rank).parallel == ParallelConfig(
                expert_parallel_size=2,
                rank=rank,
                num_redundant_experts=2,
                eplb_interval_steps=None,
                collective_timeout_s=topo.kv_transfer.timeout_s,  # driver.dispatch.collective_timeout_s
            )
    rebalancing = dataclasses.replace(topo, decode=dataclasses.replace(topo.decode, eplb_interval_steps=50))
    assert rebalancing.engine_config("decode", 1).parallel.eplb_interval_steps == 50


def test_single_device_and_replicated_experts_run_as_one_device() -> None:
    local = load_topology(CLUSTERS / "local.yaml")
    assert local.engine_config("decode").parallel == ParallelConfig()
    replicated = dataclasses.replace(
        local,
        hardware=dataclasses.replace(local.hardware, devices_per_node=3),
        decode=dataclasses.replace(local.decode, devices_per_instance=2, expert_parallel_size=1),
    )
    assert replicated.engine_config("decode", 1).parallel == ParallelConfig()  # each rank on its own


def test_per_instance_limits_are_shared_by_the_data_parallel_ranks() -> None:
    topo = load_topology(CLUSTERS / "local-ep.yaml")
    odd = dataclasses.replace(
        topo, decode=dataclasses.replace(topo.decode, max_num_seqs=7, max_num_batched_tokens=1001)
    )
    for rank in (0, 1):
        config = odd.engine_config("decode", rank)
        assert (config.max_num_seqs, config.max_num_batched_tokens) == (4, 501)  # ceil(7 / 2), ceil(1001 / 2)
    single = load_topology(CLUSTERS / "local.yaml")
    assert single.engine_config("decode").max_num_seqs == single.decode.max_num_seqs
    cm384 = load_topology(CLUSTERS / "cm384.yaml")  # decode: 27,648 per instance of 288 dies
    assert cm384.engine_config("decode", 287).max_num_seqs == 96
