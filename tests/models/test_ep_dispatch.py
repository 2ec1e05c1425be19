"""EPDispatcher over a real gloo group of spawned ranks against the single-device MoE layer.

Each rank builds the bundled model's EP shard with `load_checkpoint(placement=..., ep_rank=...)` and runs
every MoE layer (MTP's included) over its own tokens; the outputs must match the full model's MoE layer
over the same tokens. Tolerance: float32, atol/rtol 1e-5: the same products and the same two-term sums
(top-2) as the reference, but each expert's matmul runs over a different set of rows, which may change
the blocking (and so the rounding) of the GEMM.
"""

from __future__ import annotations

import torch

from pdcluster.engine.local_ranks import run_ranks
from pdcluster.engine.parallel import make_instance_group
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.ep_dispatch import EPDispatcher
from pdcluster.models.eplb import rebalance_experts
from pdcluster.models.expert_placement import ExpertPlacement, moe_layer_indices
from pdcluster.models.loader import load_checkpoint

TIMEOUT_S = 30.0


def placement_for(world_size: int, num_redundant: int, eplb: bool) -> ExpertPlacement:
    model_cfg = load_checkpoint(bundled_checkpoint_dir()).config
    num_layers = len(moe_layer_indices(model_cfg))
    n = model_cfg.n_routed_experts
    if not eplb:
        return ExpertPlacement.default(num_layers, n, world_size, num_redundant)
    load = torch.arange(1, n + 1, dtype=torch.float32).pow(2).repeat(num_layers, 1)  # skewed
    phy2log, log2phy, logcnt = rebalance_experts(load, n + num_redundant, model_cfg.n_group, 1, world_size)
    return ExpertPlacement(phy2log, log2phy, logcnt, world_size)


def moe_worker(
    rank: int, world_size: int, port: int, cases: list[tuple[int, bool, list[int], bool]]
) -> list[dict]:
    group = make_instance_group("127.0.0.1", port, rank, world_size, timeout_s=TIMEOUT_S)
    full = load_checkpoint(bundled_checkpoint_dir())
    return [moe_case(group, full, rank, world_size, *case) for case in cases]


def moe_case(
    group, full, rank: int, world_size: int, num_redundant: int, eplb: bool, tokens: list[int], overlap: bool
) -> dict:
    torch.manual_seed(1234 + rank)
    placement = placement_for(world_size, num_redundant, eplb)
    shard = load_checkpoint(bundled_checkpoint_dir(), placement=placement, ep_rank=rank)
    layers = moe_layer_indices(full.config)
    report: dict = {"num_local": [], "weights_ok": True, "load": [], "rank_rows": []}
    for row, layer_idx in enumerate(layers):
        ref_moe, ep_moe = full.model.layers[layer_idx].mlp, shard.model.layers[layer_idx].mlp
        ep_moe.dispatcher = EPDispatcher(group, placement, row, layer_idx)
        ep_moe.dispatcher.overlap_micro_batches = overlap
        report["num_local"].append(len(ep_moe.experts))
        for slot, logical in enumerate(placement.local_logical_experts(row, rank)):
            got, want = ep_moe.experts[slot].up_proj.weight, ref_moe.experts[logical].up_proj.weight
            report["weights_ok"] &= bool(torch.equal(got, want))
        hidden = torch.randn(tokens[rank], full.config.hidden_size)
        with torch.inference_mode():
            want, got = ref_moe(hidden), ep_moe(hidden)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        stats = ep_moe.dispatcher.take_stats()
        report["load"].append(stats.logical_load.tolist())
        report["rank_rows"].append(stats.rank_rows.tolist())
    return report


# (num_redundant_experts, EPLB placement, tokens per rank, two-micro-batch overlap): an idle rank, default
# replicas, EPLB replicas, and overlap with a one-token rank (an empty second micro-batch) and an idle one.
CASES = [
    (0, False, [7, 0, 3, 1], False),
    (4, False, [5, 9, 0, 2], False),
    (4, True, [3, 0, 12, 1], False),
    (4, True, [1, 6, 0, 9], True),
]


def test_ep4_dispatch_matches_single_device_moe() -> None:
    world_size, top_k = 4, 2  # top_k: the bundled model's num_experts_per_tok
    reports = run_ranks(moe_worker, world_size, CASES, timeout_s=15 * TIMEOUT_S)
    for i, (num_redundant, _, tokens, _) in enumerate(CASES):
        for rank in range(world_size):
            report = reports[rank][i]
            assert report["weights_ok"], f"rank {rank} holds wrong expert weights"
            assert report["num_local"] == [(8 + num_redundant) // world_size] * len(report["num_local"])
            for load in report["load"]:
                assert sum(load) == tokens[rank] * top_k  # every (token, expert) pair counted once
        for rows in zip(*(reports[rank][i]["rank_rows"] for rank in range(world_size)), strict=True):
            assert all(r == rows[0] for r in rows)  # every rank saw the same counts table
            assert sum(rows[0]) == sum(tokens) * top_k  # every pair dispatched exactly once
