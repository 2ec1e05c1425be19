"""`pdcluster plan --validate` and bench/planner_published.py: every published row is checked and reported
with its source; the fitted factors are what `planner.fit` fits; no figure is asserted to be met (the
bench and README report what the model predicts)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from bench import planner_published as bench
from pdcluster.entrypoints.cli import main
from pdcluster.planner import fit, published
from pdcluster.planner.efficiency import EFFICIENCY

ROOT = Path(__file__).resolve().parents[2]


def test_validate_prints_every_row_and_the_summary(capsys):
    assert main(["plan", "--validate", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    checks = [c for r in result["rows"] for c in r["checks"].values()]
    summary = result["summary"]
    assert summary["checks"] == len(checks) >= 20
    assert summary["within_15pct"] == sum(c["within_15pct"] for c in checks)
    assert summary["max_abs_error"] == pytest.approx(max(abs(c["error"]) for c in checks), abs=1e-4)
    for row in result["rows"]:
        assert "arXiv" in row["source"] or "DeepSeek" in row["source"] or "RTP-LLM" in row["source"]
        for c in row["checks"].values():
            assert c["published"] > 0 and c["predicted"] > 0 and c["no_overlap_predicted"] > 0
            assert c["within_15pct"] == (abs(c["error"]) <= published.WITHIN)
            assert c["error"] == pytest.approx(c["predicted"] / c["published"] - 1, abs=1e-3)  # rounded
    assert main(["plan", "--validate"]) == 0
    text = capsys.readouterr().out
    assert f"{summary['within_15pct']} of {summary['checks']} checks within 15%" in text


def test_the_bench_reports_what_validate_reports(capsys):
    assert bench.main(["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["summary"] == published.validate()["summary"]


def test_decode_prediction_is_step_time_over_tokens_per_step():
    deployments, _ = published.load_table()
    model = published.model_for(deployments["cm-decode"], published.load_config())
    pred = published.predict(model, "decode", {"batch": 4, "context_len": 1000, "k": 1, "acceptance": 0.7})
    assert pred["tpot_ms"] == pytest.approx(pred["step_ms"] / 1.7, rel=1e-12)
    assert pred["tokens_per_s_per_device"] == pytest.approx(4 * 1.7 / (pred["step_ms"] / 1e3), rel=1e-12)


def test_every_factor_names_its_source_and_the_fitted_ones_are_what_the_fit_gives():
    for name, eff in EFFICIENCY.items():
        for key, factor in eff.to_dict().items():
            assert len(factor["source"]) > 20, (name, key)
    shipped = fit.fitted_factors()
    for factor, entry in shipped.items():
        assert entry["fitted_on"] in entry["source"], factor
    refit = fit.fit(rounds=1)
    for factor, value in refit.items():
        # one bisection round from the shipped values: equal to the fit's rounding (4 decimals) and a step
        assert value == pytest.approx(shipped[factor]["value"], abs=2e-3), factor


def test_the_table_and_the_model_config_ship_in_the_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "data/*.json" in data["pdcluster.planner"]
    assert (
        published.TABLE_PATH.parent == published.CONFIG_PATH.parent == ROOT / "pdcluster" / "planner" / "data"
    )
    deployments, rows = published.load_table()
    for row in rows:
        dep = deployments[row["deployment"]]
        assert dep.accelerator and dep.devices and row["point"] and row["published"] and row["source"]


def test_a_row_naming_an_unknown_deployment_is_refused(tmp_path):
    raw = json.loads(published.TABLE_PATH.read_text())
    raw["rows"][0]["deployment"] = "nowhere"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unknown deployment"):
        published.load_table(path)


def test_a_deployment_with_an_unknown_overlap_mode_is_refused(tmp_path):
    raw = json.loads(published.TABLE_PATH.read_text())
    next(iter(raw["deployments"].values()))["microbatch_overlap"] = "sometimes"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="microbatch_overlap 'sometimes'"):
        published.load_table(path)
