"""Trace loading (both public traces, first rows' exact values), length scaling, prompts, bench summaries."""

from __future__ import annotations

import pytest

from pdcluster.entrypoints.bench_client import RequestResult, format_table, summarize
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.tokenizer import Tokenizer
from pdcluster.planner.trace import (
    MIN_INPUT_TOKENS,
    TraceRequest,
    build_prompts,
    default_trace_dir,
    load_trace,
    scale_trace,
)

AZURE = "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = "conversation_trace.jsonl"


def test_trace_dir_is_next_to_the_repository() -> None:
    assert (default_trace_dir() / AZURE).is_file()
    assert (default_trace_dir() / MOONCAKE).is_file()


def test_azure_first_rows() -> None:
    # 2023-11-16 18:15:46.6805900,374,44 / 18:15:50.9951690,396,109 / 18:15:51.2224670,879,55
    trace = load_trace(AZURE, num_requests=3)
    assert trace.kind == "azure" and len(trace.requests) == 3
    assert [(r.num_input_tokens, r.num_output_tokens) for r in trace.requests] == [
        (374, 44),
        (396, 109),
        (879, 55),
    ]
    assert trace.requests[0].arrival_s == 0.0
    assert trace.requests[1].arrival_s == pytest.approx(4.3145790, abs=1e-9)  # 7-digit fractions kept
    assert trace.requests[2].arrival_s == pytest.approx(4.5418770, abs=1e-9)


def test_azure_whole_file_matches_the_readme() -> None:
    trace = load_trace(default_trace_dir() / AZURE)
    assert len(trace.requests) == 19_366
    assert trace.requests[-1].arrival_s == pytest.approx(3501.7, abs=1)  # "over 3,502 s"


def test_mooncake_first_rows() -> None:
    trace = load_trace(MOONCAKE, num_requests=4)
    assert trace.kind == "mooncake"
    first = trace.requests[0]
    assert first == TraceRequest(0.0, 6758, 500, tuple(range(14)))
    assert trace.requests[1] == TraceRequest(0.0, 7322, 490, (0, *range(14, 28)))
    assert trace.requests[3] == TraceRequest(0.0, 2290, 316, (0, 42, 43, 44, 45))
    whole = load_trace(MOONCAKE)
    assert len(whole.requests) == 12_031
    assert whole.requests[-1].arrival_s == pytest.approx(3536.999)  # ms -> s


def test_bad_rows_name_the_file_and_line(tmp_path) -> None:
    bad_csv = tmp_path / "t.csv"
    bad_csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2\nnot a time,1,1\n"
    )
    with pytest.raises(ValueError, match=r"t.csv:3: not an Azure trace row"):
        load_trace(bad_csv)
    bad_jsonl = tmp_path / "t.jsonl"
    bad_jsonl.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 3}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a Mooncake trace row"):
        load_trace(bad_jsonl)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(bad_csv.rename(tmp_path / "t.txt"))


def test_scaling_lengths_and_time() -> None:
    trace = load_trace(AZURE, num_requests=5)  # inputs 374, 396, 879, 91, 91; outputs 44, 109, 55, 16, 16
    workload = scale_trace(trace, max_model_len=1024, max_tokens_cap=64, time_scale=10)
    assert [r.num_input_tokens for r in workload.requests] == [47, 50, 110, 16, 16]  # x 1024/8192, >= 16
    assert [r.num_output_tokens for r in workload.requests] == [44, 64, 55, 16, 16]  # capped at 64
    assert workload.requests[1].arrival_s == pytest.approx(0.43145790)
    assert (
        "input lengths scaled by 1024/8192 and clamped to [16, 960] (max_model_len 1024 - max_tokens_cap 64)"
        in workload.description
    )
    assert "arrival times / 10" in workload.description
    # an input longer than the context is clamped so that input + output fits
    huge = trace.__class__("azure", trace.path, [TraceRequest(0.0, 100_000, 5000)])
    (only,) = scale_trace(huge, max_model_len=256, max_tokens_cap=32).requests
    assert (only.num_input_tokens, only.num_output_tokens) == (256 - 32, 32)
    with pytest.raises(ValueError, match="max_tokens_cap"):
        scale_trace(trace, max_model_len=256, max_tokens_cap=256)
    with pytest.raises(ValueError, match="time_scale"):
        scale_trace(trace, max_model_len=256, time_scale=0)


def test_prompts_have_exact_lengths_and_mooncake_prefixes_are_shared() -> None:
    tokenizer = Tokenizer.from_dir(bundled_checkpoint_dir())
    azure = scale_trace(load_trace(AZURE, num_requests=6), max_model_len=1024)
    prompts = build_prompts(azure, tokenizer)
    assert [len(p) for p in prompts] == [r.num_input_tokens for r in azure.requests]
    assert min(len(p) for p in prompts) >= MIN_INPUT_TOKENS

    mooncake = scale_trace(load_trace(MOONCAKE, num_requests=6), max_model_len=1024)
    assert "a 512-token hash block = 4 tokens" in mooncake.description  # 512 x 1024/131072
    prompts = build_prompts(mooncake, tokenizer)
    assert [len(p) for p in prompts] == [r.num_input_tokens for r in mooncake.requests]
    # requests 0 and 1 share hash id 0 only: their first 4 tokens agree, the next block differs
    assert prompts[0][:4] == prompts[1][:4]
    assert prompts[0][4:8] != prompts[1][4:8]


def result(index: int, ttft_s: float, tpot_s: float | None, num_output_tokens: int, **kw) -> RequestResult:
    return RequestResult(
        index,
        10,
        num_output_tokens,
        0.0,
        ok=True,
        num_output_tokens=num_output_tokens,
        ttft_s=ttft_s,
        tpot_s=tpot_s,
        e2e_s=ttft_s + (tpot_s or 0) * num_output_tokens,
        **kw,
    )


def test_summary_goodput_and_percentiles() -> None:
    results = [
        result(0, 0.1, 0.01, 10, acceptance_rate=0.5, kv_transfer_s=0.002),
        result(1, 0.2, 0.05, 10, acceptance_rate=0.7, kv_transfer_s=0.004),  # misses TPOT 20 ms
        result(2, 2.0, 0.01, 10),  # misses TTFT 1 s
        result(3, 0.3, None, 1),  # one token: no TPOT to miss
        RequestResult(4, 10, 5, 0.0, error="HTTP 503: down"),
    ]
    s = summarize(results, duration_s=2.0, ttft_slo_ms=1000, tpot_slo_ms=20)
    assert (s["num_ok"], s["num_failed"]) == (4, 1)
    assert s["goodput_fraction"] == pytest.approx(2 / 5)
    assert s["goodput_requests_per_s"] == pytest.approx(1.0)
    assert s["output_tokens_per_s"] == pytest.approx(31 / 2)
    assert s["requests_per_s"] == pytest.approx(2.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(250.0)  # median of 100, 200, 300, 2000
    assert s["tpot_ms"]["p99"] == pytest.approx(49.2)  # 10, 10, 50 -> linear between the top two
    assert s["mean_acceptance_rate"] == pytest.approx(0.6)
    assert s["mean_kv_transfer_ms"] == pytest.approx(3.0)
    table = format_table(s, "workload line")
    assert "goodput (TTFT <= 1000 ms and TPOT <= 20 ms): 40.0% of requests, 1.00 req/s" in table
    assert "error: HTTP 503: down" in table


def test_cli_bench_against_a_local_server(capsys) -> None:
    """`pdcluster bench --endpoint local` end to end: an in-process server, two requests, JSON out."""
    import json

    from pdcluster.entrypoints.cli import main

    argv = ["bench", "--endpoint", "local", "--trace", MOONCAKE, "--num-requests", "2", "--time-scale", "100"]
    assert main([*argv, "--max-tokens-cap", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_ok"] == 2 and report["num_output_tokens"] == 8
    assert "input lengths scaled by 1024/131072" in report["workload"]
    assert main(["bench", "--endpoint", "local", "--trace", "nope.csv"]) == 2
    assert "trace file not found" in capsys.readouterr().err
