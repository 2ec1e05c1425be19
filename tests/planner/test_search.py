"""The search over splits of a topology's hardware, and the plan YAML it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.preflight import actor_layer_issues
from orchestrator.topology import check_topology, load_topology
from orchestrator.trace import TraceRequest
from planner.search import Evaluated, candidate_topologies, describe, plan_yaml, search, spread_counts
from planner.simulator import SimResult
from planner.workload import repeat_trace

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
        assert check_topology(t) == []
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
    best = next(t for t in candidate_topologies(base) if t.decode.num_speculative_tokens == 0)
    path = tmp_path / "plan.yaml"
    path.write_text(plan_yaml(CM384, best, "searched\nin a test"))
    assert path.read_text().startswith("# searched\n# in a test\n")
    assert main(["validate", str(path)]) == 0
    assert "ok" in capsys.readouterr().out
    written = load_topology(path)
    assert written.prefill == best.prefill and written.decode == best.decode
    assert written.hardware == base.hardware and written.slo == base.slo


def test_repeat_trace_keeps_the_rate():
    from orchestrator.trace import load_trace

    trace = load_trace("AzureLLMInferenceTrace_conv.csv", 100)
    repeated = repeat_trace(trace, 250)
    assert len(repeated.requests) == 250
    assert repeated.requests[100].num_input_tokens == trace.requests[0].num_input_tokens
    arrivals = [r.arrival_s for r in repeated.requests]
    assert arrivals == sorted(arrivals)
    with pytest.raises(ValueError, match="num_requests must be >= 1"):
        repeat_trace(trace, 0)


def test_pareto_frontier_keeps_candidates_no_other_beats_on_both():
    from planner.report import pareto_frontier

    base = load_topology(REPO / "clusters" / "local-1p2d.yaml")
    points = [
        Evaluated(base, 1, _result(g, t)) for g, t in ((1.0, 10.0), (0.5, 12.0), (2.0, 20.0), (1.5, 30.0))
    ]
    frontier = pareto_frontier(points)
    assert [(e.goodput_per_device, e.result.summary["tpot_ms"]["p90"]) for e in frontier] == [
        (1.0, 10.0),
        (2.0, 20.0),
    ]
