"""The search over splits of a topology's hardware, and the plan YAML it writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdcluster.config import check_topology, load_topology
from pdcluster.config.preflight import actor_layer_issues
from pdcluster.entrypoints.cli import main
from pdcluster.planner.search import (
    Evaluated,
    candidate_topologies,
    describe,
    fits_in_memory,
    memory_overflows,
    plan_yaml,
    search,
    spread_counts,
)
from pdcluster.planner.sim_results import SimResult
from pdcluster.planner.trace import TraceRequest
from pdcluster.planner.workload import repeat_trace

REPO = Path(__file__).resolve().parents[2]
CM384 = REPO / "clusters" / "cm384.yaml"


def test_cm384_candidates_use_its_hardware_and_pass_the_topology_rules():
    base = load_topology(CM384)
    candidates = list(candidate_topologies(base))
    assert len(candidates) > 20
    splits = set()
    for t in candidates:
        assert t.hardware == base.hardware
        assert t.prefill.num_devices + t.decode.num_devices <= base.hardware.num_devices
        # all rules but device memory, which fits_in_memory applies in the plan's weight dtype (below): in the
        # file's int8, EP16 prefill instances do not fit a die
        issues = [i.path for i in check_topology(t)]
        assert issues == ([("prefill",)] if t.prefill.expert_parallel_size == 16 else [])
        assert actor_layer_issues(t) == []  # what `pdcluster deploy` runs: EP over all of an instance
        splits.add(describe(t))
    assert len(splits) == len(candidates)  # no candidate twice
    assert {t.decode.num_speculative_tokens for t in candidates} == {0, 1}
    assert {t.decode.max_num_seqs for t in candidates} == {13824, 27648}
    # EP over every rank of an instance (deploy runs nothing else); EP64 and EP576 do not divide 256 + 32
    # experts, so 64-die prefill and 576-die decode instances (EP32 / EP288 over part) are not candidates
    assert {(t.prefill.devices_per_instance, t.prefill.expert_parallel_size) for t in candidates} == {
        (16, 16),
        (32, 32),
    }
    assert {(t.decode.devices_per_instance, t.decode.expert_parallel_size) for t in candidates} == {
        (144, 144),
        (288, 288),
    }


# DeepSeek-V3 (clusters/models/deepseek-v3.config.json) by hand, parameters per device:
# h 7168, V 129280, 61 layers (first 3 dense) + 1 MTP layer, 256 routed experts of 3 x 7168 x 2048.
V3_EXPERT = 3 * 7168 * 2048  # 44,040,192
V3_MLA = (  # q_a, its norm, q_b, kv_a, its norm, kv_b, o
    7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
)
V3_REPLICATED = (
    2 * 129_280 * 7168  # embedding, lm_head
    + 7168  # final norm
    + 62 * (V3_MLA + 2 * 7168)  # attention + 2 layer norms, 61 layers + MTP
    + 3 * 3 * 7168 * 18_432  # dense MLP of the first 3 layers
    + 59 * (256 * 7168 + V3_EXPERT)  # gate + shared expert of 58 MoE layers + the MTP layer's
    + 2 * 7168 * 7168  # MTP eh_proj
    + 3 * 7168  # MTP enorm, hnorm, shared_head.norm
)
HBM_910C = 64 * 2**30
GIB = 2**30


def test_cm384_memory_by_hand():
    assert V3_REPLICATED == 17_453_412_352
    # per die, weights + the file's KV cache (prefill 8 GiB, decode 32 GiB) against 64 GiB = 68.7 GB:
    bf16_ep16 = 2 * (V3_REPLICATED + 59 * 18 * V3_EXPERT)  # 288 / 16 = 18 experts per layer
    bf16_ep32 = 2 * (V3_REPLICATED + 59 * 9 * V3_EXPERT)  # 288 / 32 = 9
    int8_ep16 = V3_REPLICATED + 59 * 18 * V3_EXPERT
    int8_ep32 = V3_REPLICATED + 59 * 9 * V3_EXPERT
    assert (bf16_ep16, bf16_ep32) == (128_448_192_512, 81_677_508_608)
    assert (int8_ep16, int8_ep32) == (64_224_096_256, 40_838_754_304)
    assert bf16_ep16 + 8 * GIB > HBM_910C and bf16_ep32 + 8 * GIB > HBM_910C  # the file's split too
    assert int8_ep16 + 8 * GIB > HBM_910C  # 72.8 GB: EP16 does not fit even in int8
    assert int8_ep32 + 8 * GIB <= HBM_910C  # 49.4 GB
    bf16_ep288 = 2 * (V3_REPLICATED + 59 * 1 * V3_EXPERT)
    int8_ep144 = V3_REPLICATED + 59 * 2 * V3_EXPERT
    assert bf16_ep288 == 40_103_567_360 and bf16_ep288 + 32 * GIB > HBM_910C  # 74.5 GB
    assert int8_ep144 + 32 * GIB <= HBM_910C  # 57.0 GB; EP288 in int8: 54.4 GB


def test_search_refuses_cm384_splits_whose_weights_and_kv_exceed_a_die():
    candidates = list(candidate_topologies(load_topology(CM384)))
    fit, too_big = fits_in_memory(candidates, "bfloat16")
    assert fit == [] and len(too_big) == len(candidates)  # bf16 DeepSeek-V3 fits no split of cm384
    ep16 = next(t for t in candidates if t.prefill.expert_parallel_size == 16)
    assert (
        "prefill (EP16, 18 routed experts per device per MoE layer): 128.4 GB of bfloat16 weights + 8.6 GB "
        "of KV cache per device > 68.7 GB of one ascend-910c device"
    ) in memory_overflows(ep16, "bfloat16")

    fit, too_big = fits_in_memory(candidates, "int8")
    assert fit and too_big
    assert {t.prefill.expert_parallel_size for t in fit} == {32}  # both decode sizes (EP144, EP288) fit
    assert {t.decode.expert_parallel_size for t in fit} == {144, 288}
    assert {t.prefill.expert_parallel_size for t in too_big} == {16}
    assert all(memory_overflows(t, "int8")[0].startswith("prefill (EP16") for t in too_big)


def test_spread_counts():
    assert spread_counts(23, 4) == [6, 12, 17, 23]
    assert spread_counts(1, 4) == [1]
    assert spread_counts(0, 4) == []


def _result(goodput_per_s: float, tpot_p90_ms: float) -> SimResult:
    summary = {"goodput_requests_per_s": goodput_per_s, "tpot_ms": {"p90": tpot_p90_ms}, "ttft_ms": {}}
    return SimResult([], 1.0, summary)


def test_search_ranks_by_goodput_per_device():
    base = load_topology(REPO / "clusters" / "local-1p2d.yaml")
    small, large = list(candidate_topologies(base))[:2]
    goodput = {id(small): 1.0, id(large): 1.5}

    def fake_simulate(topology, requests):
        return _result(goodput[id(topology)], 10.0)

    ranked = search(base, [TraceRequest(0.0, 16, 4)], fake_simulate, [small, large])
    per_device = [e.goodput_per_device for e in ranked]
    assert per_device == sorted(per_device, reverse=True)
    assert all(isinstance(e, Evaluated) for e in ranked)


def test_plan_yaml_is_a_topology_pdcluster_validate_accepts(tmp_path, capsys):
    base = load_topology(CM384)
    fit, _ = fits_in_memory(list(candidate_topologies(base)), "fp8")
    best = next(t for t in fit if t.decode.num_speculative_tokens == 0)
    path = tmp_path / "plan.yaml"
    path.write_text(plan_yaml(CM384, best, "searched\nin a test", weight_dtype="fp8"))
    assert path.read_text().startswith("# searched\n# in a test\n")
    assert main(["validate", str(path)]) == 0
    assert "ok" in capsys.readouterr().out
    written = load_topology(path)
    assert written.prefill == best.prefill and written.decode == best.decode
    assert written.model.weight_dtype == "fp8"  # the weight dtype the search ranked with
    assert dataclasses.replace(written.model, weight_dtype=base.model.weight_dtype) == base.model
    assert written.hardware == base.hardware and written.slo == base.slo


def test_repeat_trace_keeps_the_rate():
    from pdcluster.planner.trace import load_trace

    trace = load_trace("AzureLLMInferenceTrace_conv.csv", 100)
    repeated = repeat_trace(trace, 250)
    assert len(repeated.requests) == 250
    assert repeated.requests[100].num_input_tokens == trace.requests[0].num_input_tokens
    arrivals = [r.arrival_s for r in repeated.requests]
    assert arrivals == sorted(arrivals)
    with pytest.raises(ValueError, match="num_requests must be >= 1"):
        repeat_trace(trace, 0)


def test_pareto_frontier_keeps_candidates_no_other_beats_on_both():
    from pdcluster.planner.report import pareto_frontier

    base = load_topology(REPO / "clusters" / "local-1p2d.yaml")
    points = [
        Evaluated(base, 1, _result(g, t)) for g, t in ((1.0, 10.0), (0.5, 12.0), (2.0, 20.0), (1.5, 30.0))
    ]
    frontier = pareto_frontier(points)
    assert [(e.goodput_per_device, e.result.summary["tpot_ms"]["p90"]) for e in frontier] == [
        (1.0, 10.0),
        (2.0, 20.0),
    ]
