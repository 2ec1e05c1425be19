"""EPDispatcher over a real gloo group of spawned ranks against the single-device MoE layer.

Each rank builds the bundled model's EP shard with `load_checkpoint(placement=..., ep_rank=...)` and runs
every MoE layer (MTP's included) over its own tokens; the outputs must match the full model's MoE layer
over the same tokens. Tolerance: float32, atol/rtol 1e-5: the same products and the same two-term sums
(top-2) as the reference, but each expert's matmul runs over a different set of rows, which may change
the blocking (and so the rounding) of the GEMM.
"""

from __future__ import annotations

import torch

from engine.parallel import make_instance_group
from models import bundled_checkpoint_dir
from models.ep_dispatch import EPDispatcher
from models.eplb import rebalance_experts
from models.expert_placement import ExpertPlacement, moe_layer_indices
from models.loader import load_checkpoint
from tests.multiproc import run_ranks

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


def moe_worker(rank: int, world_size: int, port: int, num_redundant: int, eplb: bool, tokens: list[int]):
    torch.manual_seed(1234 + rank)
    group = make_instance_group("127.0.0.1", port, rank, world_size, timeout_s=TIMEOUT_S)
    placement = placement_for(world_size, num_redundant, eplb)
    full = load_checkpoint(bundled_checkpoint_dir())
    shard = load_checkpoint(bundled_checkpoint_dir(), placement=placement, ep_rank=rank)
    layers = moe_layer_indices(full.config)
    report = {"num_local": [], "max_err": [], "weights_ok": True}
    for row, layer_idx in enumerate(layers):
        ref_moe, ep_moe = full.model.layers[layer_idx].mlp, shard.model.layers[layer_idx].mlp
        ep_moe.dispatcher = EPDispatcher(group, placement, row, layer_idx)
        report["num_local"].append(len(ep_moe.experts))
        for slot, logical in enumerate(placement.local_logical_experts(row, rank)):
            got, want = ep_moe.experts[slot].up_proj.weight, ref_moe.experts[logical].up_proj.weight
            report["weights_ok"] &= bool(torch.equal(got, want))
        hidden = torch.randn(tokens[rank], full.config.hidden_size)
        with torch.inference_mode():
            want, got = ref_moe(hidden), ep_moe(hidden)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        report["max_err"].append(float((got - want).abs().max()) if hidden.numel() else 0.0)
        stats = ep_moe.dispatcher.take_stats()
        report.setdefault("load", []).append(stats.logical_load.tolist())
        report.setdefault("rank_rows", []).append(stats.rank_rows.tolist())
    return report


def check(world_size: int, num_redundant: int, eplb: bool, tokens: list[int]) -> dict:
    reports = run_ranks(moe_worker, world_size, num_redundant, eplb, tokens, timeout_s=4 * TIMEOUT_S)
    top_k = 2  # the bundled model's num_experts_per_tok
    for rank, report in reports.items():
        assert report["weights_ok"], f"rank {rank} holds wrong expert weights"
        assert report["num_local"] == [(8 + num_redundant) // world_size] * len(report["num_local"])
        for load in report["load"]:
            assert sum(load) == tokens[rank] * top_k  # every (token, expert) pair counted once
    for row_rows in zip(*(r["rank_rows"] for r in reports.values()), strict=True):
        assert all(rows == row_rows[0] for rows in row_rows)  # every rank saw the same table
        assert sum(row_rows[0]) == sum(tokens) * top_k  # every pair dispatched exactly once
    return reports


def test_ep2_matches_single_device_moe_with_an_idle_rank() -> None:
    check(world_size=2, num_redundant=0, eplb=False, tokens=[7, 0])


def test_ep2_redundant_experts_default_placement() -> None:
    check(world_size=2, num_redundant=2, eplb=False, tokens=[5, 9])


def test_ep4_eplb_placement_with_replicas() -> None:
    check(world_size=4, num_redundant=4, eplb=True, tokens=[3, 0, 12, 1])
