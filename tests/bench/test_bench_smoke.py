"""Smoke tests of the benchmarks: each `main()` runs with its smallest options on a throwaway checkpoint
and prints one JSON object with the documented keys. No timing is asserted (speed lives in bench/)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from bench import engine_step, kv_int8, moe_ep, spec_decode
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.loader import save_checkpoint
from tests.orchestrator.conftest import random_tiny_config, train_small_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer checkpoint with an MTP module (loads in well under a second); its context holds
    the held-out prompts, which are long in the small tokenizer's tokens."""
    path = tmp_path_factory.mktemp("bench_ckpt")
    tok = train_small_tokenizer()
    torch.manual_seed(0)
    config = dataclasses.replace(random_tiny_config(tok.get_vocab_size()), max_position_embeddings=512)
    save_checkpoint(DeepseekV3ForCausalLM(config), path)
    tok.save(str(path / "tokenizer.json"))
    return path


def run_json(capsys: pytest.CaptureFixture[str], main, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


CONFIG_KEYS = {"threads", "torch", "machine", "checkpoint", "num_prompts", "other_processes_cpu_fraction"}


def test_engine_step(capsys, checkpoint):
    result = run_json(
        capsys, engine_step.main, "--model", str(checkpoint), "--batch-sizes", "2", "--num-steps", "2",
        "--num-warmup-steps", "1", "--prompt-len", "8", "--target-batch-size", "2",
    )  # fmt: skip
    assert CONFIG_KEYS <= result["config"].keys() and result["overhead_includes"]
    assert [(r["batch_size"], r["async_scheduling"]) for r in result["results"]] == [(2, False), (2, True)]
    sync = result["results"][0]
    for key in ("wall_ms", "model_ms", "overhead_ms"):
        assert {"mean", "p50", "p90"} <= sync[key].keys()
    assert sync["num_steps"] == 2 and sync["tokens_per_step"] == 2
    assert sync["model_ms"]["mean"] > 0
    assert {"schedule", "prepare_input", "sample", "outputs"} <= sync["breakdown_ms"].keys()
    assert "error" in result["results"][1] or "overhead_ms" in result["results"][1]
    assert {"met_async_off", "met_async_on", "description"} <= result["target"].keys()


def test_spec_decode(capsys, checkpoint):
    result = run_json(
        capsys, spec_decode.main, "--model", str(checkpoint), "--ks", "0,2", "--batch-sizes", "2",
        "--num-prompts", "2", "--max-tokens", "4",
    )  # fmt: skip
    assert CONFIG_KEYS <= result["config"].keys()
    assert [r["k"] for r in result["results"]] == [0, 2]
    for r in result["results"]:
        assert r["num_output_tokens"] == 8 and r["outputs_match_k0"]
        assert {"output_tokens_per_s", "decode_tokens_per_s", "acceptance_rate"} <= r.keys()
    assert len(result["results"][1]["acceptance_rate_per_position"]) == 2
    assert result["speedup_vs_k0"]["2"]["0"]["output_tokens_per_s"] == 1.0
    assert result["target"]["met"] is None  # batch 1 was not run


def test_kv_int8(capsys, checkpoint):
    result = run_json(
        capsys, kv_int8.main, "--model", str(checkpoint), "--dtypes", "float32", "--num-prompts", "2",
        "--max-tokens", "3", "--num-repeats", "1",
    )  # fmt: skip
    assert CONFIG_KEYS <= result["config"].keys()
    kv = result["kv_cache_bytes_per_token"]
    assert kv["by_cache_dtype"]["int8"] * 2 < kv["by_cache_dtype"]["float32"]
    assert (
        kv["ratios"]["int8_vs_float32"]["bytes"]
        == f"{kv['by_cache_dtype']['int8']}/{kv['by_cache_dtype']['float32']}"
    )
    agreement = result["agreement"]["int8_vs_float32"]
    assert agreement["num_tokens"] == 6
    assert 0 <= agreement["free_running_num_matching_tokens"] <= 6
    assert 0 <= agreement["teacher_forced_num_matching_tokens"] <= 6
    assert [(r["model_dtype"], r["kv_cache_dtype"]) for r in result["results"]] == [
        ("float32", "auto"),
        ("float32", "int8"),
    ]


@pytest.mark.parametrize("module", [engine_step, spec_decode, kv_int8, moe_ep])
def test_help_and_bad_model(capsys, module, tmp_path):
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    assert "--model" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        module.main(["--model", str(tmp_path)])
    assert exc.value.code == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


def test_moe_ep(capsys):
    """EP 2 over two spawned ranks (gloo), the bundled model only, one timed step."""
    argv = ["--ep", "2", "--batches", "2", "--num-steps", "1", "--num-warmup-steps", "1", "--skip-moe64"]
    result = run_json(capsys, moe_ep.main, *argv, "--threads", "1")
    tiny = result["results"]["2"]["tiny"]
    (row,) = tiny["rows"]
    assert set(row) == {
        "batch", "step_ms", "attention_ms", "dispatch_ms", "expert_ms", "combine_ms", "bytes_per_step",
        "analytic_bytes_per_step",
    }  # fmt: skip
    assert row["batch"] == 2 and row["analytic_bytes_per_step"] == 2 * 2 * 2 // 2 * 256 * 4 * 3
    assert row["bytes_per_step"] % (256 * 4) == 0  # whole float32 rows of hidden_size 256
    assert tiny["num_physical_experts"] == 8 + 4 and tiny["imbalance_eplb"] >= 1.0
