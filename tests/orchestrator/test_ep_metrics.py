"""/metrics families of the EP figures (`entrypoints.openai.ep_metrics`) from the engine's own `EPStats`."""

from __future__ import annotations

import dataclasses

from prometheus_client import generate_latest

from pdcluster.engine.expert_parallel import EPStats
from pdcluster.entrypoints.openai.metrics import ApiMetrics


def _stats(rank: int) -> dict:
    return dataclasses.asdict(
        EPStats(
            rank=rank,
            num_ranks=2,
            moe_layers=[1, 4],
            num_steps=10,
            num_idle_steps=3 + rank,
            expert_load=[[5, 0, 1], [2, 2, 2]],
            rank_rows=[[6, 2], [3, 3]],
            imbalance=[1.5, 1.0],
            total_imbalance=1.25,
            dispatch_s=0.5,
            combine_s=0.25,
            expert_s=2.0,
            dispatch_bytes=1024,
            combine_bytes=2048,
            counts_bytes=64,
            num_rebalances=1,
            rebalance_s=0.125,
            last_rebalance_s=0.125,
            rebalance_moved_bytes=4096,
        )
    )


def test_ep_figures_of_every_rank_reach_metrics() -> None:
    ranks = {
        "decode-0": {"num_running": 1, "ep": _stats(0)},
        "decode-0.1": {"num_running": 0, "ep": _stats(1)},
        "prefill-0": {"num_requests": 0, "ep": None},  # a single-device instance: no EP families
    }
    text = generate_latest(ApiMetrics(lambda: {"ranks": ranks}).registry).decode()
    assert 'pdcluster_rank_num_running{rank="decode-0.1"} 0.0' in text
    assert 'pdcluster_ep_idle_steps_total{rank="decode-0.1"} 4.0' in text
    assert 'pdcluster_ep_imbalance{layer="1",rank="decode-0"} 1.5' in text
    assert 'pdcluster_ep_expert_load{expert="0",layer="1",rank="decode-0"} 5.0' in text
    assert 'pdcluster_ep_seconds_total{phase="combine",rank="decode-0"} 0.25' in text
    assert 'pdcluster_ep_bytes_total{kind="counts",rank="decode-0.1"} 64.0' in text
    assert 'pdcluster_ep_rebalance_moved_bytes_total{rank="decode-0"} 4096.0' in text
    assert 'pdcluster_ep_last_rebalance_seconds{rank="decode-0"} 0.125' in text
    assert 'rank="prefill-0"' not in text.split("pdcluster_ep_steps")[1]  # no EP figures for it


def test_no_ep_rank_no_ep_families() -> None:
    text = generate_latest(ApiMetrics(lambda: {"ranks": {"decode-0": {"num_running": 2}}}).registry).decode()
    assert "pdcluster_ep_" not in text and 'pdcluster_rank_num_running{rank="decode-0"} 2.0' in text
