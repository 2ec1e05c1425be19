"""bench/planner_published.py: every published row is checked and reported with its source, and the
catalog's efficiency factors all name where they come from. No figure is asserted to be met: the bench
reports what the model predicts (README, "Performance model against published deployments")."""

from __future__ import annotations

import json

import pytest

from bench import planner_published as pub
from pdcluster.models.config import DeepseekV3Config
from pdcluster.orchestrator.efficiency import EFFICIENCY


def test_every_row_is_predicted_and_compared(capsys):
    assert pub.main(["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    checks = [c for r in result["rows"] for c in r["checks"].values()]
    assert result["summary"]["checks"] == len(checks) == 20
    assert result["summary"]["within_15pct"] == sum(c["within_15pct"] for c in checks)
    for row in result["rows"]:
        assert "arXiv" in row["source"] or "DeepSeek" in row["source"] or "RTP-LLM" in row["source"]
        for c in row["checks"].values():
            assert c["published"] > 0 and c["predicted"] > 0 and c["no_overlap_predicted"] > 0
            assert c["within_15pct"] == (abs(c["error"]) <= pub.WITHIN)
            assert c["error"] == pytest.approx(c["predicted"] / c["published"] - 1, abs=1e-3)  # rounded


def test_decode_prediction_is_step_time_over_tokens_per_step():
    config = DeepseekV3Config.from_json_file(pub.CONFIG_PATH)
    model = pub.model_for(pub.DEPLOYMENTS["cm-decode"], config)
    pred = pub.predict_decode(model, batch=4, context_len=1000, k=1, acceptance=0.7)
    assert pred["tpot_ms"] == pytest.approx(pred["step_ms"] / 1.7, rel=1e-12)
    assert pred["tokens_per_s_per_device"] == pytest.approx(4 * 1.7 / (pred["step_ms"] / 1e3), rel=1e-12)


def test_every_efficiency_factor_names_its_source():
    for name, eff in EFFICIENCY.items():
        for key, factor in eff.to_dict().items():
            assert len(factor["source"]) > 20, (name, key)
            assert "fitted" not in factor["source"], (name, key)
