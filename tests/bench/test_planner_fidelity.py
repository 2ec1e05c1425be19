"""`bench.planner_fidelity --live-from`: a recorded live half simulated again, nothing deployed; the control
plane derived again from the recorded probes, the ratios of the new simulation to the recorded live run."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from bench import planner_fidelity
from bench.common import ratio
from pdcluster.entrypoints.bench_client import RequestResult

ROOT = Path(__file__).resolve().parents[2]


def _record(tmp_path: Path) -> Path:
    probe = RequestResult(0, 48, 13, 0.0, ok=True, num_output_tokens=13, ttft_s=0.045, tpot_s=0.011,
                          acceptance_rate=0.5,
                          phases={"route_s": 0.001, "reserve_s": 0.006, "prefill_s": 0.025,
                                  "prefill_cpu_wait_s": 0.005, "kv_transfer_s": 0.040, "admit_s": 0.001,
                                  "first_decode_step_s": 0.016})  # fmt: skip
    live = {"cluster": str(ROOT / "clusters" / "local.yaml"), "rate_per_s": 2.0, "num_requests": 6,
            "live_acceptance_rate": 0.5, "live_ttft_ms_p50": 40.0, "live_ttft_ms_p90": 80.0,
            "live_tpot_ms_p50": 9.0, "live_tpot_ms_p90": 12.0, "sim_ttft_ms_p50": 1.0,
            "control_plane_probes": [{"result": dataclasses.asdict(probe), "prompt_len": 48,
                                      "host_cpu_s": 0.5}] * 2}  # fmt: skip
    config = {"trace": planner_fidelity.TRACE, "num_requests": 6, "max_tokens_cap": 16, "calibration": None}
    path = tmp_path / "planner_fidelity.json"
    path.write_text(json.dumps({"name": "planner_fidelity", "output": {"config": config, "points": [live]}}))
    return path


def test_live_from_simulates_the_recorded_live_half_again(tmp_path, capsys):
    path = _record(tmp_path)
    assert planner_fidelity.main(["--live-from", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["live_from"] == str(path)
    (point,) = result["points"]
    # the control plane comes from the recorded probes: route + reserve, and the prefill rank's 80% share of
    # a core less the engine and the driver's core the simulator adds to that step (0.5 s of driver CPU)
    assert point["control_plane_ms"]["dispatch_s"] == pytest.approx(7.0, abs=1e-9)
    cores = float(os.cpu_count() or 1)
    assert point["background_cores"] == pytest.approx(max(0.0, round(cores / 0.8 - 2.0, 3)), abs=1e-9)
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p90"):
            sim, live = point[f"sim_{metric}_{q}"], point[f"live_{metric}_{q}"]
            assert sim > 0 and point[f"sim_over_live_{metric}_{q}"] == ratio(sim, live)


def test_live_from_refuses_live_only_options(tmp_path, capsys):
    with pytest.raises(SystemExit):
        planner_fidelity.main(["--live-from", str(_record(tmp_path)), "--eager"])
    assert "--live-from re-simulates a recorded run" in capsys.readouterr().err


def test_overlap_split_parts_the_requests_that_ran_alone_from_those_that_overlapped():
    from types import SimpleNamespace

    from pdcluster.planner.trace import TraceRequest

    requests = [TraceRequest(0.0, 16, 3), TraceRequest(0.1, 16, 3), TraceRequest(5.0, 16, 3)]
    # live spans: 0 .. 0.2 + 0.05 x 2 = 0.3 and 0.1 .. 0.4 overlap; the third (5.0 .. 5.3) runs alone
    live = [[16, 3, 0.2, 0.05], [16, 3, 0.2, 0.05], [16, 3, 0.2, 0.05]]
    sim = [SimpleNamespace(ok=True, ttft_s=0.1, tpot_s=0.05),
           SimpleNamespace(ok=True, ttft_s=0.3, tpot_s=0.1),
           SimpleNamespace(ok=True, ttft_s=0.2, tpot_s=None)]  # fmt: skip
    split = planner_fidelity.overlap_split(requests, live, sim)
    assert split["alone"] == {"num_requests": 1, "ttft": 1.0, "tpot": None}
    # the medians of 0.5 and 1.5 (TTFT), of 1 and 2 (TPOT)
    assert split["overlapped"] == {"num_requests": 2, "ttft": 1.0, "tpot": 1.5}
