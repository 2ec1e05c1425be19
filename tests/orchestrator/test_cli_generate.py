"""`pdcluster generate` / `pdcluster demo` on the engine (`engine.llm.LLMEngine`).

Most tests run the CLI in-process (`main(argv)`) against the random checkpoint from conftest.py; one runs
the real console entry point in a subprocess to check the exit code and the absence of a traceback, and
one runs the bundled trained checkpoint.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster import models
from pdcluster.config import DEFAULT_TOPOLOGY_PATH
from pdcluster.entrypoints.cli import main
from pdcluster.entrypoints.cli.generate import TextStreamer
from pdcluster.entrypoints.demo import heldout_prompts
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.tokenizer import Tokenizer
from tests.conftest import eager_topology_file
from tests.orchestrator.conftest import RANDOM_CONTEXT_LEN

PROMPT = "def parse(text):"
TIMING_KEYS = {"load_s", "queue_s", "prefill_s", "decode_s", "ttft_s", "tpot_s", "e2e_s", "tokens_per_s"}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generate_json(capsys: pytest.CaptureFixture[str], checkpoint: Path, *argv: str) -> dict:
    code, out, err = run_cli(capsys, "generate", "--model", checkpoint, "--json", *argv)
    assert code == 0, err
    return json.loads(out)


# ---- generate: output ------------------------------------------------------------------------------
def test_json_schema_and_token_count(capsys, random_checkpoint):
    result = generate_json(capsys, random_checkpoint, "--prompt", PROMPT, "--max-tokens", "7")
    assert set(result) == {"text", "token_ids", "finish_reason", "num_prompt_tokens", "timing", "spec_decode"}
    assert set(result["timing"]) == TIMING_KEYS
    assert all(isinstance(v, float) and v >= 0 for v in result["timing"].values())
    assert len(result["token_ids"]) == 7
    assert result["finish_reason"] == "length"
    tokenizer = Tokenizer.from_dir(random_checkpoint)
    assert result["num_prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert result["text"] == tokenizer.decode(result["token_ids"])


def test_plain_mode_prints_prompt_then_completion(capsys, random_checkpoint):
    expected = generate_json(capsys, random_checkpoint, "--prompt", PROMPT, "--max-tokens", "5")["text"]
    argv = ("generate", "--model", random_checkpoint, "--prompt", PROMPT, "--max-tokens", "5")
    code, out, err = run_cli(capsys, *argv)
    assert code == 0
    assert out == PROMPT + expected + "\n"
    assert "5 tokens (length)" in err and "tokens/s" in err


def test_greedy_is_deterministic(capsys, random_checkpoint):
    argv = ("--prompt", PROMPT, "--max-tokens", "12")
    runs = [generate_json(capsys, random_checkpoint, *argv) for _ in range(2)]
    assert runs[0]["token_ids"] == runs[1]["token_ids"]


def test_sampling_is_deterministic_per_seed(capsys, random_checkpoint):
    def sample(seed: int, *extra: str) -> list[int]:
        argv = ("--prompt", PROMPT, "--max-tokens", "16", "--temperature", "1.0", "--seed", str(seed), *extra)
        return generate_json(capsys, random_checkpoint, *argv)["token_ids"]

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)  # ~300 near-uniform choices per token: equal runs would be a seed bug
    assert sample(7, "--top-k", "20", "--top-p", "0.9") == sample(7, "--top-k", "20", "--top-p", "0.9")


def test_stops_at_the_model_context(capsys, random_checkpoint):
    result = generate_json(capsys, random_checkpoint, "--prompt", PROMPT, "--max-tokens", "1000")
    assert result["finish_reason"] == "length"
    assert result["num_prompt_tokens"] + len(result["token_ids"]) == RANDOM_CONTEXT_LEN


# ---- generate: errors and help ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x", "--max-tokens", "0"], "--max-tokens: must be a positive integer"),
        (["--prompt", "x", "--max-tokens", "many"], "--max-tokens: invalid positive integer value"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature: must be >= 0"),
        (["--prompt", "x", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
        (["--prompt", "x", "--model", "/nonexistent/checkpoint"], "model directory not found: /nonexistent"),
        (["--prompt", "x", "--device", "no-such-device"], "not a device name"),
        (["--prompt", "x = 1\n" * RANDOM_CONTEXT_LEN], "leaves no room for a completion"),
    ],
)
def test_errors_are_one_message_and_exit_code_2(capsys, random_checkpoint, argv, message):
    code, out, err = run_cli(capsys, "generate", "--model", random_checkpoint, *argv)
    assert code == 2
    assert out == ""
    assert message in err
    assert "Traceback" not in err


def test_streamer_writes_the_released_text_after_the_prompt():
    """The engine releases whole characters only (tests/engine/test_stopping.py); the streamer writes the
    prompt with the first text, then each piece as it comes, and a newline at the end."""
    out = io.StringIO()
    streamer = TextStreamer(out, prefix=">>> ")
    streamer("")
    assert out.getvalue() == ""  # nothing for a prompt with no text yet
    for piece in ("naïve ", "✓ → ", "完成"):
        streamer(piece)
    streamer.finish()
    assert out.getvalue() == ">>> naïve ✓ → 完成\n"


def test_checkpoint_dir_without_config_is_a_clear_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", tmp_path, "--prompt", "x")
    assert code == 2
    assert "cannot load the checkpoint" in err and "config.json" in err


def test_error_exit_code_from_the_real_process():
    """The console script path: the process exits 2 with one message and no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdcluster.entrypoints.cli",
            "generate",
            "--prompt",
            "x",
            "--model",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "pdcluster generate: error: model directory not found: /nonexistent"


def test_help_names_the_default_model_and_units(capsys):
    code, out, _ = run_cli(capsys, "generate", "--help")
    assert code == 0
    flat = " ".join(out.split())  # argparse wraps long lines
    assert str(bundled_checkpoint_dir()) in flat
    assert "python -m pdcluster.models.train_tiny" in flat
    for phrase in ("greedy", "tokens", "seconds", "ttft_s", "tpot_s", "Default: 64"):
        assert phrase in flat


def test_bundled_checkpoint_dir_is_inside_the_package():
    assert bundled_checkpoint_dir() == Path(models.__file__).resolve().parent / "tiny"


# ---- engine options --------------------------------------------------------------------------------
def test_speculative_decoding_reports_acceptance_and_keeps_greedy_output(capsys, random_checkpoint):
    base = generate_json(capsys, random_checkpoint, "--prompt", PROMPT, "--max-tokens", "12")
    spec = generate_json(
        capsys, random_checkpoint, "--prompt", PROMPT, "--max-tokens", "12", "--num-speculative-tokens", "2"
    )
    assert spec["token_ids"] == base["token_ids"]
    assert spec["spec_decode"]["num_draft_tokens"] > 0
    assert len(spec["spec_decode"]["acceptance_rate_per_position"]) == 2
    assert base["spec_decode"]["num_draft_tokens"] == 0


def test_batch_file_generates_every_prompt(capsys, random_checkpoint, tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text(f"{PROMPT}\n\nimport os\\nimport sys\n")
    code, out, err = run_cli(
        capsys, "generate", "--model", random_checkpoint, "--batch-file", batch, "--max-tokens", "3", "--json"
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["num_requests"] == 2 and len(result["outputs"]) == 2
    assert all(len(o["token_ids"]) == 3 for o in result["outputs"])


def test_int8_kv_cache_option(capsys, random_checkpoint):
    out = generate_json(
        capsys, random_checkpoint, "--prompt", PROMPT, "--max-tokens", "4", "--kv-cache-dtype", "int8"
    )
    assert len(out["token_ids"]) == 4


# ---- demo ------------------------------------------------------------------------------------------
def test_heldout_prompts_are_def_lines_with_docstrings():
    prompts = heldout_prompts(3)
    assert len(prompts) == 3
    assert len({p.source.split(":")[0] for p in prompts}) == 3  # three different files
    for p in prompts:
        assert p.text.startswith("def ") and p.text.rstrip().endswith('"""')


@pytest.mark.slow
def test_demo_is_the_cluster_job(capsys, tmp_path):
    """`make demo`'s command end to end on a local Ray cluster (~25 s): clusters/local.yaml deployed (its
    eager copy: `make demo` itself compiles the decode forward, tests/cluster/test_cluster_compiled.py
    covers that), held-out completions through the API, 4 Azure trace requests replayed, a summary with
    acceptance and KV transfer time, everything shut down, exit code 0."""
    cluster = eager_topology_file(DEFAULT_TOPOLOGY_PATH, tmp_path)
    argv = ["demo", "--cluster", cluster, "--num-requests", "4", "--max-tokens-cap", "8"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert out.count("=== [") == 3
    assert "requests: 4 ok / 4 (0 failed)" in out
    assert "mean acceptance rate: 0." in out and "mean KV transfer:" in out


# ---- the bundled checkpoint ------------------------------------------------------------------------
def test_bundled_model_writes_python(capsys):
    """Proves the bundled checkpoint + tokenizer + loop produce code-shaped text, not noise (~1.5 s).

    The model never saw this prompt's function (it is not in the standard library); greedy output of a
    model trained on stdlib source should indent a body and use Python keywords.
    """
    argv = ("generate", "--prompt", "def fibonacci(n):", "--max-tokens", "48", "--json")
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    text = json.loads(out)["text"]
    assert "\n    " in text, text  # a newline and an indented body
    keywords = {"return", "if", "for", "in", "else", "None", "not", "self", "def", "is", "and", "or"}
    words = set(text.replace("(", " ").replace(")", " ").replace(":", " ").split())
    assert len(keywords & words) >= 2, text
    assert sum(c.isprintable() or c in "\n\t" for c in text) >= 0.95 * len(text), text
