"""The planner's workload keeps a trace's recorded lengths unless asked to scale them."""

from __future__ import annotations

import pytest

from pdcluster.planner.workload import plan_workload


@pytest.fixture
def trace_csv(tmp_path):
    path = tmp_path / "t.csv"
    rows = [(374, 44), (9000, 10), (5, 300), (2000, 128)]
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{40 + i}.0000000,{i_},{o}" for i, (i_, o) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_recorded_lengths_are_kept_and_only_what_the_model_cannot_hold_is_clamped(trace_csv):
    workload = plan_workload(trace_csv, max_model_len=4096, max_tokens_cap=128)
    assert [r.num_input_tokens for r in workload.requests] == [374, 4096 - 128, 16, 2000]
    assert [r.num_output_tokens for r in workload.requests] == [44, 10, 128, 128]
    assert "1 inputs clamped to 3968 tokens" in workload.description
    assert "1 raised to 16" in workload.description
    assert "1 outputs capped at 128" in workload.description


def test_scaling_to_another_context_is_explicit(trace_csv):
    # Azure's reference context is 8192: scaling to 4096 halves every input before clamping
    workload = plan_workload(trace_csv, max_model_len=163840, scale_to_context=4096)
    assert [r.num_input_tokens for r in workload.requests] == [187, 4096 - 128, 16, 1000]
    with pytest.raises(ValueError, match="context to scale to"):
        plan_workload(trace_csv, max_model_len=4096, scale_to_context=8192)
