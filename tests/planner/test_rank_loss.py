"""The simulated loss of one rank of an EP instance (`planner.rank_loss`, `pdcluster plan --fail-rank`).

The simulations use the roofline model of clusters/local-ep.yaml (8 routed experts + 2 redundant over EP2
per pool) and clusters/cm384.yaml's pools: what is asserted is bookkeeping (counts, blocks, the outage
window, every token accounted for), exact; step times are compared only as larger/smaller.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdcluster.config import load_topology
from pdcluster.driver.elastic_budget import survivor_expert_slots
from pdcluster.models.elastic_placement import PlacementRefused, shrink_placement
from pdcluster.models.expert_placement import ExpertPlacement
from pdcluster.planner.plan import PlanOptions, simulate_topology, step_models
from pdcluster.planner.rank_loss import RankLoss, parse_rank_loss, shrink_experts, shrunk_model
from pdcluster.planner.step_model import DecodeRow, StepShape
from pdcluster.planner.trace import TraceRequest

ROOT = Path(__file__).resolve().parents[2]


def test_parse_rank_loss_forms_and_errors():
    assert parse_rank_loss("decode0:3@60") == RankLoss("decode", 0, 3, 60.0, None)  # the pool's stall time
    assert RankLoss("decode", 0, 3, 60.0).with_recovery(5.0).recovery_s == 5.0
    assert RankLoss("decode", 0, 3, 60.0, 4.0).with_recovery(5.0).recovery_s == 4.0
    assert parse_rank_loss(" prefill12:0@1.5+4 ") == RankLoss("prefill", 12, 0, 1.5, 4.0)
    for bad in ("decode:3@60", "decoder0:1@1", "decode0:1@x", "decode0:1", "decode0:1@1+", "d0:1@1"):
        with pytest.raises(ValueError, match="--fail-rank"):
            parse_rank_loss(bad)
    with pytest.raises(ValueError, match="at_s must be a finite number >= 0"):
        parse_rank_loss("decode0:1@-1")


def test_shrink_experts_keeps_every_expert_and_counts_what_is_loaded():
    # 256 routed + 32 redundant over EP32: 9 slots per rank; 31 survivors keep 9 slots (279 replicas)
    experts = shrink_experts(256, 288, 8, 1, 32, 1.0, lost_rank=3, max_local_experts=9)
    assert experts.num_physical == 31 * 9
    assert 0 <= experts.num_loaded <= 9  # at most the lost rank's own experts come from the checkpoint
    assert experts.shrunk_imbalance >= 1 and experts.eplb_imbalance >= 1
    assert experts.relative_imbalance >= 1
    # no redundancy: each of 8 ranks holds one expert; a survivor grows a slot for the orphan
    bare = shrink_experts(8, 8, 1, 1, 8, 1.0, lost_rank=0, max_local_experts=2)
    assert bare.num_physical == 7 * 2 and bare.num_loaded == 7  # the orphan + the 6 other grown slots
    with pytest.raises(ValueError):  # a lost rank id out of range is refused by shrink_placement
        shrink_experts(8, 8, 1, 1, 8, 1.0, lost_rank=8, max_local_experts=2)
    with pytest.raises(PlacementRefused):  # one slot each: the orphan has nowhere to go
        shrink_experts(8, 8, 1, 1, 8, 1.0, lost_rank=0, max_local_experts=1)
    # 8 ranks of 1 slot, no redundancy: 7 survivors held to 1 slot each cannot keep all 8 experts. The
    # refusal is a ValueError (what `pdcluster plan` reports as an error) saying what would fix it.
    with pytest.raises(ValueError, match=r"7 surviving ranks × 1 expert slots cannot hold 8 .* >= 2") as e:
        shrink_placement(ExpertPlacement.default(1, 8, 8, 0), {0}, None, max_local_experts=1)
    assert e.type is PlacementRefused


def test_shrunk_model_prices_fewer_ranks():
    topology = load_topology(ROOT / "clusters" / "cm384.yaml")
    _, decode = step_models(topology, PlanOptions(trace="unused"))
    shrunk, experts = shrunk_model(decode, 7, survivor_expert_slots(topology, "decode"))
    assert shrunk.parallel.devices == 287 and shrunk.parallel.expert_parallel_size == 287
    assert shrunk.parallel.num_redundant_experts == experts.num_physical - 256
    assert decode.parallel.devices == 288  # the healthy model is left as it was
    step = StepShape(decode=(DecodeRow(4096, 2),) * (288 * 96), num_speculative_tokens=1)
    assert shrunk.step_time_s(step) > decode.step_time_s(step)  # the same batch on one rank less


def _requests(n: int, rate_per_s: float, prompt: int, output: int) -> list[TraceRequest]:
    return [TraceRequest(i / rate_per_s, prompt, output) for i in range(n)]


def test_decode_rank_loss_recomputes_the_lost_rank_requests_and_serves_after_recovery():
    topology = load_topology(ROOT / "clusters" / "local-ep.yaml")
    requests = _requests(40, 20.0, 64, 48)  # first arrival at 0 s: scheduled_s is simulated time
    options = PlanOptions(trace="unused")
    healthy = simulate_topology(topology, requests, options)
    loss = RankLoss("decode", 0, 1, 0.5)  # down for the pool's elastic_stall_s
    lost = simulate_topology(topology, requests, options, [loss])
    (report,) = lost.rank_losses
    stall_s = topology.decode.elastic_stall_s
    assert report["served_again_at_s"] - report["lost_at_s"] == pytest.approx(stall_s, abs=1e-9)
    assert report["lost_at_s"] >= 0.5
    assert report["num_ranks_after"] == 1
    assert report["num_kv_blocks_after"] == report["num_kv_blocks_before"] // 2
    assert report["num_requests_recomputed"] > 0
    assert report["experts"]["num_physical_after"] == 8  # one survivor holds all 8 logical experts
    assert lost.summary["num_ok"] == healthy.summary["num_ok"] == 40
    for before, after in zip(healthy.results, lost.results, strict=True):
        # every token still counted once, the prompt as the trace has it, despite the recompute
        assert (after.num_input_tokens, after.num_output_tokens) == (64, 48)
        assert (before.num_input_tokens, before.num_output_tokens) == (64, 48)
    # nothing leaves the decode instance during the outage: no request finishes inside it
    ends = [r.scheduled_s + r.e2e_s for r in lost.results]
    start, end = report["lost_at_s"], report["served_again_at_s"]
    assert not [t for t in ends if start + 1e-9 < t < end - 1e-9]
    assert max(ends) > max(r.scheduled_s + r.e2e_s for r in healthy.results)


def test_prefill_rank_loss_and_refusals():
    topology = load_topology(ROOT / "clusters" / "local-ep.yaml")
    requests = _requests(20, 10.0, 200, 8)
    options = PlanOptions(trace="unused")
    result = simulate_topology(topology, requests, options, [RankLoss("prefill", 0, 0, 0.3, 1.0)])
    (report,) = result.rank_losses
    assert report["num_requests_recomputed"] is None  # prefill jobs restart in their own queue
    assert result.summary["num_ok"] == 20
    first_tokens = [r.scheduled_s + r.ttft_s for r in result.results]  # one prefill instance, down
    start, end = report["lost_at_s"], report["served_again_at_s"]
    assert not [t for t in first_tokens if start + 1e-9 < t < end - 1e-9]
    assert [t for t in first_tokens if t >= end - 1e-9]  # the queued prefills ran after the recovery
    for bad, match in (
        (RankLoss("decode", 1, 0, 0.1), "1 instance"),
        (RankLoss("decode", 0, 2, 0.1), "ranks 0..1"),
    ):
        with pytest.raises(ValueError, match=match):
            simulate_topology(topology, requests, options, [bad])
    single = load_topology(ROOT / "clusters" / "local.yaml")
    with pytest.raises(ValueError, match="one-rank instance"):
        simulate_topology(single, requests, options, [RankLoss("decode", 0, 0, 0.1)])
    tp = dataclasses.replace(topology, decode=dataclasses.replace(topology.decode, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        simulate_topology(tp, requests, options, [RankLoss("decode", 0, 0, 0.1)])


def test_a_loss_the_survivors_memory_cannot_absorb_is_the_live_refusal():
    """local-ep's decode survivor must hold all 8 experts in 5 slots' memory (its KV cache takes the rest of
    its device): the live driver refuses to shrink (`survivor_expert_slots`), so the plan does too."""
    topology = load_topology(ROOT / "clusters" / "local-ep.yaml")
    full = dataclasses.replace(topology.decode, kv_cache_memory_bytes=topology.hardware.spec.hbm_bytes)
    topology = dataclasses.replace(topology, decode=full)
    assert survivor_expert_slots(topology, "decode") == 5
    requests = _requests(10, 20.0, 64, 8)
    with pytest.raises(
        PlacementRefused,
        match=r"decode0:1@0.1\+5: live, the instance would not shrink: .* 5 expert slots cannot hold 8",
    ):
        simulate_topology(topology, requests, PlanOptions(trace="unused"), [RankLoss("decode", 0, 1, 0.1)])
