"""Live vs simulated on clusters/local.yaml, a loose bound (the README's table holds the measured figures).

One small live run (Ray actors, gRPC KV, the OpenAI API; `bench.planner_fidelity.live_and_simulated`)
and the simulation of the same workload with the perf model calibrated in this test (`pdcluster profile
--quick`, seconds before). The issue's target (10%) is a benchmark figure measured by hand; this test
must hold on a shared 2-core machine under load, where two known gaps grow with the load (README, "Live
vs simulated"): the calibration times CPU seconds (the live wall times also wait for a core), and the
simulation leaves out control-plane latency (Ray calls, the decode poll loop, SSE). So:
- p50 TPOT within a factor of 4 either way (0.3-1.0 measured at 97% of the CPU taken by other work);
- p50 TTFT simulated at most 1.5x the live one (it can only be lower by what is left out; a prefill or
  handoff priced several times too slow fails).
Only a gross modelling error (a wrong unit, a missing phase, a step priced 10x off) fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main

REPO = Path(__file__).resolve().parents[2]
TPOT_FACTOR = 4.0
TTFT_UPPER = 1.5


@pytest.mark.timeout(600)
def test_simulated_p50s_are_within_a_factor_of_the_live_cluster(tmp_path):
    from bench.planner_fidelity import live_and_simulated

    calibration = tmp_path / "local.calibration.json"
    profile = ["profile", str(REPO / "clusters" / "local.yaml"), "--quick", "--no-progress"]
    assert main([*profile, "--output", str(calibration)]) == 0
    point = live_and_simulated(
        str(REPO / "clusters" / "local.yaml"), 0.5, num_requests=8, max_tokens_cap=16, calibration=calibration
    )
    assert point["live_num_failed"] == 0
    assert 1 / TPOT_FACTOR <= point["sim_over_live_tpot_ms_p50"] <= TPOT_FACTOR, point
    assert 0 < point["sim_over_live_ttft_ms_p50"] <= TTFT_UPPER, point
