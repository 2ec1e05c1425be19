"""Live vs simulated on clusters/local.yaml (its eager copy), a loose bound (the README's table holds the
measured figures).

One small live run (Ray actors, gRPC KV, the OpenAI API; `bench.planner_fidelity.live_and_simulated`)
and the simulation of the same workload with the perf model calibrated in this session (`pdcluster profile
--quick`, the shared fixture). The issue's target (10%) is a benchmark figure measured by hand; this test
must hold on a shared 2-core machine under load, where the calibration times CPU seconds while the live
wall times also wait for a core (README, "Live vs simulated"). The live control-plane path and the
node's other load (`planner.control_plane`) are probed on the same deployment just before the replay.
Bounds, from what the bench showed
(`python -m bench.planner_fidelity`, local.yaml at 0.5 req/s, 24 requests, 97% of the CPU taken by other
work): sim/live p50 TTFT 0.27 (0.18 without the control plane), p50 TPOT 0.50; on a quiet machine before
(no control plane) TTFT 0.24-0.40, TPOT 0.64-0.87. So:
- p50 TPOT within a factor of 4 either way (measured 0.3-1.0);
- p50 TTFT simulated between 1/10 and 3x the live one: not absurdly fast (a missing phase or a step
  priced 10x too fast fails; the lowest measured, 0.27, leaves a factor 2.7 for heavier load) and not
  slower than live beyond what load swings make of 8 requests (a prefill or handoff priced several times
  too slow fails). The control-plane probes are wall clock, taken under the load of their moment: with the
  suite on two xdist workers beside other jobs (load average 6-11) one run simulated 1.98x live.
Only a gross modelling error (a wrong unit, a missing phase, a step priced 10x off) fails.
"""

from __future__ import annotations

import pytest

TPOT_FACTOR = 4.0
TTFT_UPPER = 3.0
TTFT_LOWER = 0.1


@pytest.mark.timeout(600)
def test_simulated_p50s_are_within_a_factor_of_the_live_cluster(quick_calibration, eager_local_yaml):
    from bench.planner_fidelity import live_and_simulated

    calibration = quick_calibration.path  # `pdcluster profile --quick` (tests/planner/conftest.py)
    point = live_and_simulated(  # the profiled file: both eager
        str(eager_local_yaml), 0.5, num_requests=8, max_tokens_cap=16, calibration=calibration, num_probes=4
    )
    assert point["live_num_failed"] == 0
    assert 1 / TPOT_FACTOR <= point["sim_over_live_tpot_ms_p50"] <= TPOT_FACTOR, point
    assert TTFT_LOWER <= point["sim_over_live_ttft_ms_p50"] <= TTFT_UPPER, point
    assert point["control_plane_ms"]["dispatch_s"] > 0  # the probes measured the path
