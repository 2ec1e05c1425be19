"""bench/RESULTS.md is what bench/results/*.json give; bench.record keeps the last JSON object."""

from __future__ import annotations

import json

import pytest

from bench import record, results


def test_results_md_is_regenerated_from_the_json_files() -> None:
    assert results.RESULTS_MD.read_text() == results.render(), "run: python -m bench.results"


def test_every_result_names_its_command_commit_and_machine() -> None:
    for path in sorted(results.RESULTS_DIR.glob("*.json")):
        rec = json.loads(path.read_text())
        assert rec["name"] == path.stem
        assert rec["command"].startswith("python -m ") and rec["commit"] and rec["machine"], path.name


def test_record_takes_the_last_json_object_after_progress_lines() -> None:
    out = 'warming up {not json\n{"a": 1}\nprogress\n{"b": {"c": [1, 2]}}\n'
    assert record.last_json_object(out) == {"b": {"c": [1, 2]}}
    with pytest.raises(ValueError, match="no JSON object"):
        record.last_json_object("no json here")


def test_render_turns_lists_of_rows_into_tables() -> None:
    lines = results.render_output({"x": 1.23456, "rows": [{"a": 1, "b": 2.5}, {"a": 2}]})
    assert "- `x`: 1.235" in lines
    assert "| a | b |" in lines and "| 2 |  |" in lines
