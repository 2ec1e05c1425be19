"""Live vs simulated on clusters/local.yaml, a loose bound (the README's table holds the measured figures).

One small live run (Ray actors, gRPC KV, the OpenAI API; `bench.planner_fidelity.live_and_simulated`)
and the simulation of the same workload with the perf model calibrated in this test (`pdcluster profile
--quick`, seconds before, so under the same machine load). The bound is a factor of 3 on p50 TPOT and
p50 TTFT either way: the issue's target (10%) is a benchmark figure measured by hand; here the live side
runs on a shared 2-core machine with the test suite and other work, and the quick calibration has few
samples, so only a gross modelling error (a wrong unit, a missing phase, a step priced 10x off) fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main

REPO = Path(__file__).resolve().parents[2]
FACTOR = 3.0


@pytest.mark.timeout(600)
def test_simulated_p50s_are_within_a_factor_of_the_live_cluster(tmp_path):
    from bench.planner_fidelity import live_and_simulated

    calibration = tmp_path / "local.calibration.json"
    assert (
        main(
            [
                "profile",
                str(REPO / "clusters" / "local.yaml"),
                "--quick",
                "--no-progress",
                "--output",
                str(calibration),
            ]
        )
        == 0
    )
    point = live_and_simulated(
        str(REPO / "clusters" / "local.yaml"), 0.5, num_requests=8, max_tokens_cap=16, calibration=calibration
    )
    assert point["live_num_failed"] == 0
    for metric in ("sim_over_live_tpot_ms_p50", "sim_over_live_ttft_ms_p50"):
        assert 1 / FACTOR <= point[metric] <= FACTOR, (metric, point)
