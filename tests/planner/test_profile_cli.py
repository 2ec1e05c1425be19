"""`pdcluster profile --quick` runs the live engine of clusters/local.yaml and writes a calibration the
planner loads back."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from pdcluster.config import load_topology
from pdcluster.entrypoints.cli import main
from pdcluster.planner.calibration import FORMAT, read_calibration
from pdcluster.planner.control_plane import QUICK_REQUESTS, ControlPlane, control_plane_from_calibration
from pdcluster.planner.perf_model import perf_model_for
from pdcluster.planner.step_model import DecodeRow, StepShape

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two engines timed, then the live cluster probed (the session's one profile run)
def test_profile_quick_writes_a_calibration(quick_calibration):
    out = quick_calibration.path
    doc = json.loads(out.read_text())
    assert doc["format"] == FORMAT and doc["accelerator"] == "cpu"
    assert read_calibration(out)["factors"] == doc["factors"]
    assert {"kv_link", "handoff_overhead_s"} <= set(doc["factors"])
    assert len(doc["residuals"]) == 4  # the quick grid: 2 prefill + 2 decode points
    for row in doc["residuals"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
    assert out.with_suffix(".txt").read_text().startswith("role")
    assert "calibration written to" in quick_calibration.stdout
    model = perf_model_for(load_topology(ROOT / "clusters" / "local.yaml"), "decode", calibration=out)
    assert model.efficiency.kv_link.source.startswith("measured here")
    assert model.step_time_s(StepShape(decode=(DecodeRow(64, 2),), num_speculative_tokens=1)) > 0
    # the live control-plane probes (QUICK_REQUESTS of them, then half as many after an idle pause), each
    # piece of the path measured, none negative
    cp = doc["control_plane"]
    assert cp["num_failed"] == 0
    assert sum(1 for p in cp["points"] if not p.get("after_pause_s")) == QUICK_REQUESTS
    assert sum(1 for p in cp["points"] if p.get("after_pause_s")) == QUICK_REQUESTS // 2
    assert set(cp["values"]) == {f.name for f in fields(ControlPlane)}
    assert all(v >= 0 for v in cp["values"].values())
    assert cp["values"]["dispatch_s"] > 0  # route + reserve cross Ray: never free
    assert all({"route_s", "reserve_s", "first_decode_step_s"} <= set(p["phases"]) for p in cp["points"])
    assert control_plane_from_calibration(out) == ControlPlane(**cp["values"])


def test_profile_refuses_a_negative_probe_count(capsys):
    assert main(["profile", str(ROOT / "clusters" / "local.yaml"), "--quick", "--no-progress",
                 "--control-plane-requests", "-1", "--output", "/dev/null"]) == 2  # fmt: skip
    assert "--control-plane-requests must be >= 0" in capsys.readouterr().err


def test_profile_refuses_a_topology_it_cannot_measure_here(capsys):
    assert main(["profile", str(ROOT / "clusters" / "cm384.yaml"), "--quick"]) == 2
    assert "accelerator is 'ascend-910c'" in capsys.readouterr().err
