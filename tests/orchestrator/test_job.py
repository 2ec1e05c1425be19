"""`python -m pdcluster.entrypoints.job` (the `ray job submit` entry point) end to end on a local Ray."""

from __future__ import annotations

import json

import pytest

from pdcluster.config import DEFAULT_TOPOLOGY_PATH
from pdcluster.entrypoints.job import main
from tests.conftest import eager_topology_file

PHASES = {"queue_s", "prefill_s", "kv_transfer_s", "first_decode_step_s", "total_s"}


@pytest.mark.slow
def test_job_replays_a_trace_slice_to_jsonl(tmp_path, capsys) -> None:
    """4 Azure trace requests (outputs capped at 4 tokens) through clusters/local.yaml (its eager copy,
    `tests.conftest.eager_topology_file`): exit code 0, one JSON line per request in trace order with its 4
    greedy token ids, finish reason, TTFT and phases, and the summary on stdout. The job starts and stops its
    own Ray; a Ray session already up in this process (another module's) is attached to and left running."""
    ray = pytest.importorskip("ray")
    was_initialized = ray.is_initialized()
    output = tmp_path / "results.jsonl"
    cluster = eager_topology_file(DEFAULT_TOPOLOGY_PATH, tmp_path / "cluster")
    argv = ["--cluster", str(cluster), "--trace", "AzureLLMInferenceTrace_conv.csv", "--num-requests", "4"]
    argv += ["--max-tokens-cap", "4"]
    code = main([*argv, "--time-scale", "100", "--output", str(output)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert ray.is_initialized() == was_initialized

    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert "error" not in r, r
        assert r["max_tokens"] == 4 and len(r["token_ids"]) == 4
        assert r["finish_reason"] == "length"
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert PHASES <= set(r["phases"]) and r["phases"]["kv_transfer_bytes"] > 0
    assert "requests: 4 ok / 4 (0 failed)" in captured.out
    assert f"wrote 4 results to {output}" in captured.out
