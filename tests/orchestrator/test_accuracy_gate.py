"""`pdcluster accuracy` and its gate (issue 38, item 3): the YAML fields and their errors at FILE:LINE, the
metrics' exact definitions, the table / JSON, exit 1 naming the metric under a threshold, and
`deploy --require-accuracy` refusing before Ray starts. The end-to-end runs use short bands (tens of
tokens, one window) so they take seconds; `clusters/local.yaml` itself is run by hand (see the report)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from pdcluster.config import TopologyError, read_topology
from pdcluster.engine.accuracy import emulate_weight_dtype_, repetition_rate, stream_windows
from pdcluster.entrypoints.cli import main
from tests.conftest import tiny_model

SMALL = """\
name: small
decode:
  num_speculative_tokens: 1
accuracy:
  num_prompts: 2
  num_generations: 1
  band_lengths: "24,40,64"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_yaml_errors_name_file_and_line(tmp_path):
    path = write(
        tmp_path,
        """\
        name: t
        kv_precision:
          short: {max_tokens: 128, kv_cache_dtype: int4}
          long: {kv_cache_dtype: bfloat16, key_layers: "0-9", key_layers_dtype: float32}
        decode:
          kv_cache_dtype: int8
        accuracy:
          max_mean_kl: -1
        """,
    )
    with pytest.raises(TopologyError) as exc:
        read_topology(path)
    lines = str(exc.value).splitlines()
    assert f"{path}:3: kv_precision.short.kv_cache_dtype: 'int4' is not one of" in lines[0]
    assert any(f"{path}:8: accuracy.max_mean_kl: must be >= 0" in line for line in lines)
    # the key-layer and pool rules need the rest valid: fix the dtype and the threshold
    path.write_text(path.read_text().replace("int4", "int8").replace("-1", "0.1"))
    with pytest.raises(TopologyError) as exc:
        read_topology(path)
    text = str(exc.value)
    assert f"{path}:4: kv_precision.long.key_layers: '0-9' past the model's 5 layers" in text
    assert f"{path}:6: decode.kv_cache_dtype: 'int8' conflicts with kv_precision" in text


def test_bands_must_increase_and_long_is_unbounded(tmp_path):
    path = write(
        tmp_path, "name: t\nkv_precision:\n  short: {max_tokens: 512}\n  medium: {max_tokens: 256}\n"
    )
    with pytest.raises(TopologyError, match="band max_tokens must increase"):
        read_topology(path)
    path = write(tmp_path, "name: t\nkv_precision:\n  long: {max_tokens: 512}\n")
    with pytest.raises(TopologyError, match="max_tokens must be null"):
        read_topology(path)


def test_gate_names_each_threshold_missed_and_skips_the_unmeasured():
    """Each threshold on its own band: agreement and KL against the value, the MTP acceptance drop and the
    repetition-rate increase against the reference (a band without a reference is not checked)."""
    from types import SimpleNamespace

    from pdcluster.config.quality import AccuracyConfig
    from pdcluster.engine.accuracy import BandMetrics
    from pdcluster.entrypoints.accuracy_gate import gate_failures

    ok = dict(top1_agreement=1.0, mean_kl=0.0, mtp_acceptance=0.5, reference_mtp_acceptance=0.5)
    ok.update(repetition_rate=0.1, reference_repetition_rate=0.1)
    bands = {
        "fine": BandMetrics(10, "auto", **ok),
        "top1": BandMetrics(10, "int8", **{**ok, "top1_agreement": 0.5}),
        "kl": BandMetrics(10, "int8", **{**ok, "mean_kl": 0.25}),
        "mtp": BandMetrics(10, "int8", **{**ok, "mtp_acceptance": 0.25}),
        "rep": BandMetrics(10, "int8", **{**ok, "repetition_rate": 0.5}),
        "mtp_better": BandMetrics(10, "int8", **{**ok, "mtp_acceptance": 0.75, "repetition_rate": 0.0}),
        "unmeasured": BandMetrics(
            10, "int8", **{**ok, "reference_mtp_acceptance": None, "mtp_acceptance": 0.0}
        ),
    }
    assert gate_failures(SimpleNamespace(accuracy=AccuracyConfig()), bands) == [
        "top1: top1_agreement 0.5000 < min_top1_agreement 0.95",
        "kl: mean_kl 0.25 > max_mean_kl 0.05",
        "mtp: mtp_acceptance 0.2500 vs reference 0.5000, > max_mtp_acceptance_drop 0.05",
        "rep: repetition_rate 0.5000 vs reference 0.1000, > max_repetition_rate_increase 0.05",
    ]


def test_repetition_rate_counts_repeated_ngrams():
    assert repetition_rate([1, 2, 3, 4, 5, 6]) == 0.0
    # 4-grams of 1 2 3 4 1 2 3 4: (1234)(2341)(3412)(4123)(1234): one of five repeats
    assert repetition_rate([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)
    assert repetition_rate([7] * 10) == pytest.approx(6 / 7)
    assert repetition_rate([1, 2]) == 0.0


def test_stream_windows_are_evenly_spaced():
    windows = stream_windows(list(range(100)), 10, 3)
    assert windows.tolist() == [list(range(0, 10)), list(range(30, 40)), list(range(60, 70))]
    with pytest.raises(ValueError, match="11 windows"):
        stream_windows(list(range(100)), 9, 12)


def test_int8_weight_emulation_error_is_half_a_step():
    reference, model = tiny_model(), tiny_model()
    emulate_weight_dtype_(model, "int8")
    w0 = reference.model.layers[0].self_attn.o_proj.weight
    w1 = model.model.layers[0].self_attn.o_proj.weight
    step = w0.abs().amax(1, keepdim=True) / 127
    assert not torch.equal(w0, w1)
    assert bool(((w1 - w0).abs() <= step / 2 + 1e-7).all())  # round to nearest; 1e-7: float32 division
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)  # lm_head stays


def test_accuracy_table_and_json_for_the_reference_configuration(tmp_path, capsys):
    path = write(tmp_path, SMALL)
    code, out, _ = run_cli(capsys, "accuracy", path, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["passed"] is True and report["failures"] == []
    assert list(report["metrics"]) == ["short", "medium", "long"]
    long = report["metrics"]["long"]
    assert long["length"] == 64 and long["top1_agreement"] == 1.0 and long["mean_kl"] == 0.0
    assert long["repetition_rate"] == long["reference_repetition_rate"]
    assert long["mtp_acceptance"] == long["reference_mtp_acceptance"] is not None
    by_dtype = report["mtp_acceptance_by_kv_dtype"]
    assert list(by_dtype) == ["auto"]
    assert by_dtype["auto"] == pytest.approx(sum(m["mtp_acceptance"] for m in report["metrics"].values()) / 3)
    code, out, _ = run_cli(capsys, "accuracy", path)
    assert code == 0 and "gate: passed" in out and out.splitlines()[0].split()[:3] == ["band", "length", "KV"]


def test_gate_refuses_int8_kv_at_an_exact_agreement_threshold(tmp_path, capsys):
    path = write(
        tmp_path,
        SMALL
        + "  min_top1_agreement: 1.0\n  max_mean_kl: null\n"
        + "kv_precision:\n  short: {max_tokens: 24, kv_cache_dtype: int8}\n  long: {kv_cache_dtype: auto}\n",
    )
    code, out, err = run_cli(capsys, "accuracy", path, "--json")
    report = json.loads(out)
    short, long = report["metrics"]["short"], report["metrics"]["long"]
    assert short["kv_dtypes"] == "int8" and long["kv_dtypes"] == "auto"
    assert long["top1_agreement"] == 1.0 and long["mean_kl"] == 0.0  # float32 KV: the reference itself
    assert short["mean_kl"] > 0  # int8 KV changes the distributions
    if short["top1_agreement"] < 1.0:
        assert code == 1 and report["passed"] is False
        assert "short: top1_agreement" in err and "min_top1_agreement 1.0" in err
    else:  # int8 flipped no argmax on these 22 positions: a KL threshold must then catch it
        assert code == 0
    path.write_text(path.read_text().replace("max_mean_kl: null", "max_mean_kl: 0"))
    code, _, err = run_cli(capsys, "accuracy", path)
    assert code == 1 and "short: mean_kl" in err and "max_mean_kl 0" in err


def test_deploy_require_accuracy_refuses_before_ray(tmp_path, capsys, monkeypatch):
    import ray

    import pdcluster.driver.deployment

    def refuse(*_args, **_kwargs):
        raise AssertionError("Ray was started though the accuracy gate failed")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(pdcluster.driver.deployment, "init_local_ray", refuse)
    yaml_text = SMALL.replace(
        "num_speculative_tokens: 1\n", "num_speculative_tokens: 1\n  kv_cache_dtype: int8\n"
    )
    path = write(tmp_path, yaml_text + "  max_mean_kl: 0\napi:\n  port: 0\n")
    code, out, err = run_cli(capsys, "deploy", path, "--require-accuracy")
    assert code == 1
    assert "accuracy gate failed" in err and "mean_kl" in err and "gate: FAILED" in out
