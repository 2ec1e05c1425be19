"""Dynamic P:D simulated (`planner.autoscale_sim`): the live controller moves instances as the load shifts,
no request is lost, a quiet controller changes nothing, a move past its drain bound is aborted.

Step models are linear (defined here) so runs are fast and deterministic; the SLO is set in the topology.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from pdcluster.config import DecodePoolConfig, HardwareConfig, PrefillPoolConfig, SLOConfig, Topology
from pdcluster.config.autoscale import AutoscaleConfig
from pdcluster.driver import autoscale
from pdcluster.driver.autoscale_capacity import capacity_from_models, tokens_per_step
from pdcluster.planner import autoscale_sim
from pdcluster.planner.autoscale_sim import simulate_autoscale
from pdcluster.planner.simulator import SimOptions, simulate
from pdcluster.planner.trace import TraceRequest
from tests.planner.test_simulator import LinearModel

CONFIG = AutoscaleConfig(enabled=True, interval_s=0.5, window_s=2.0, dwell_s=4.0, drain_timeout_s=10.0)


def topology(num_prefill: int = 2) -> Topology:
    return Topology(
        name="autoscale-sim",
        hardware=HardwareConfig(devices_per_node=4),
        prefill=PrefillPoolConfig(num_instances=num_prefill),
        decode=DecodePoolConfig(num_instances=4 - num_prefill),
        slo=SLOConfig(ttft_ms=1000.0, tpot_ms=50.0),
        autoscale=CONFIG,
    )


def models() -> tuple[LinearModel, LinearModel]:
    return LinearModel(0.01, 1e-4, handoff_s=0.001), LinearModel(0.01, 1e-4, handoff_s=0.001)


def poisson(rate: float, start_s: float, duration_s: float, num_input: int, num_output: int, rng) -> list:
    out, now_s = [], start_s
    while (now_s := now_s + rng.expovariate(rate)) < start_s + duration_s:
        out.append(TraceRequest(now_s, num_input, num_output))
    return out


def phase_shift() -> list[TraceRequest]:
    """15 s prompt-heavy (prefill needs ~2.5 instances), 15 s output-heavy (decode needs ~2.5)."""
    rng = random.Random(0)
    return poisson(29.0, 0.0, 15.0, 800, 4, rng) + poisson(49.0, 15.0, 15.0, 32, 200, rng)


def test_capacity_from_the_step_models():
    prefill, decode = models()
    cap = capacity_from_models(
        topology(), prefill, decode, (), tpot_slo_s=0.05, context_len=100, prompt_len=800
    )
    # two 800-token chunks fill the 2048-token budget: 1600 / (0.01 + 1600e-4)
    assert cap.prefill_tokens_per_s == pytest.approx(1600 / 0.17, rel=1e-12)  # float sums, not modelling
    assert cap.decode_batch == 64  # 64 rows: 0.0164 s <= 0.05 s
    assert cap.decode_tokens_per_s == pytest.approx(64 / 0.0164, rel=1e-12)  # one token per row per step
    cap = capacity_from_models(
        topology(), prefill, decode, (), tpot_slo_s=0.0105, context_len=100, prompt_len=800
    )
    assert cap.decode_batch == 5  # 0.01 + 5e-4 <= 0.0105 < 0.01 + 6e-4
    assert tokens_per_step((0.5, 0.5)) == 1.75


def test_moves_follow_the_phase_and_no_request_is_lost():
    prefill, decode = models()
    requests = phase_shift()
    auto = simulate_autoscale(topology(), requests, SimOptions(prefill, decode))
    done = [m for m in auto.moves if m.outcome == "done"]
    assert done, auto.moves
    assert (done[0].source, done[0].target) == ("decode", "prefill") and done[0].decided_s < 15.0
    assert any((m.source, m.target) == ("prefill", "decode") and 15.0 <= m.decided_s < 30.0 for m in done)
    assert all(m.reason for m in auto.moves)
    assert auto.result.summary["num_ok"] == len(requests)  # 0 lost
    for _, num_prefill, num_decode, num_parked in auto.roles:  # never a pool emptied
        assert num_prefill >= 1 and num_decode >= 1 and num_prefill + num_decode + num_parked <= 4
    static = simulate(topology(), requests, SimOptions(prefill, decode)).summary
    assert auto.result.summary["goodput_requests_per_s"] > static["goodput_requests_per_s"]


def test_a_quiet_controller_changes_nothing():
    prefill, decode = models()
    requests = poisson(2.0, 0.0, 30.0, 200, 50, random.Random(1))
    auto = simulate_autoscale(topology(), requests, SimOptions(prefill, decode))
    static = simulate(topology(), requests, SimOptions(prefill, decode))
    assert auto.moves == []
    # the same events in the same order: identical per-request times
    assert [(r.ttft_s, r.tpot_s, r.e2e_s) for r in auto.result.results] == [
        (r.ttft_s, r.tpot_s, r.e2e_s) for r in static.results
    ]


def test_a_move_past_its_drain_bound_is_aborted(monkeypatch):
    """A forced decode->prefill move of a decode with long requests running: aborted at the bound, the
    instance serves on as decode, every request completes."""
    calls = []

    def forced(now_s, instances, signals, capacity, policy):
        busy = [i for i in instances if i.role == "decode" and i.batch > 0]
        if busy and not calls:
            calls.append(now_s)
            return autoscale.Move(busy[0].instance_id, "decode", "prefill", "forced by the test")
        return None

    monkeypatch.setattr(autoscale_sim, "decide", forced)
    prefill, decode = models()
    requests = poisson(4.0, 0.0, 10.0, 64, 400, random.Random(2))
    config = dataclasses.replace(CONFIG, drain_timeout_s=1.0)
    auto = simulate_autoscale(topology(), requests, SimOptions(prefill, decode), config=config)
    assert [m.outcome for m in auto.moves] == ["aborted"]
    move = auto.moves[0]
    assert move.done_s is not None and 1.0 < move.done_s - move.decided_s <= 1.0 + CONFIG.interval_s
    assert auto.result.summary["num_ok"] == len(requests)


def test_plan_autoscale_flag_prints_the_moves(tmp_path, capsys):
    """`pdcluster plan --autoscale --json`: the controller's run beside the static one, each move with its
    reason; a prompt-heavy rate on 2P2D moves a decode instance to prefill."""
    import json
    from pathlib import Path

    from pdcluster.entrypoints.cli import main

    local = (Path(__file__).resolve().parents[2] / "clusters" / "local.yaml").read_text()
    text = local.replace("devices_per_node: 2 ", "devices_per_node: 4 ").replace(
        "num_instances: 1", "num_instances: 2"
    )
    text = text.replace("path: null", f"path: {autoscale_sim.__file__.rsplit('/', 2)[0]}/models/tiny")
    path = tmp_path / "local4.yaml"
    path.write_text(text + "autoscale:\n  window_s: 2\n  dwell_s: 5\n")
    argv = [
        "plan",
        str(path),
        "--trace",
        "AzureLLMInferenceTrace_conv.csv",
        "--num-requests",
        "300",
        "--rate",
        "30",
    ]
    assert main([*argv, "--no-sweep", "--autoscale", "--json", "--out", str(tmp_path / "out")]) == 0
    printed = json.loads(capsys.readouterr().out)
    auto = printed["autoscale"]
    assert auto["num_requests"] == printed["num_requests"] == 300 and auto["num_failed"] == 0
    first = auto["moves"][0]  # made once decode's forecast load (these prompts' outputs) leaves it room:
    assert (first["source"], first["target"]) == ("decode", "prefill")  # it may end after the last request
    assert first["outcome"] in ("done", "in progress")  # not aborted
    assert "prefill utilization" in first["reason"]


def test_low_load_parks_instances_and_a_rise_brings_them_back():
    """The seed's minimum compute unit: at low load the controller parks instances (out of routing) down to
    the pools' minimums; as load rises it unparks them; no request is lost."""
    prefill, decode = models()
    rng = random.Random(3)
    requests = poisson(1.0, 0.0, 20.0, 100, 20, rng) + poisson(29.0, 20.0, 15.0, 800, 4, rng)
    config = dataclasses.replace(CONFIG, park=True)
    auto = simulate_autoscale(topology(), requests, SimOptions(prefill, decode), config=config)
    parks = [m for m in auto.moves if m.target == "parked" and m.outcome == "done"]
    unparks = [m for m in auto.moves if m.source == "parked" and m.outcome == "done"]
    assert len(parks) == 2 and all(m.decided_s < 20.0 for m in parks)  # 2P2D -> 1P1D + 2 parked
    assert min(r[3] for r in auto.roles) == 0 and max(r[3] for r in auto.roles) == 2
    assert unparks and all(m.decided_s >= 20.0 and m.target == "prefill" for m in unparks)
    assert auto.result.summary["num_ok"] == len(requests)
