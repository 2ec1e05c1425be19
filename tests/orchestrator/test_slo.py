"""`config.slo`: the TPOT definition and the one SLO rule behind the API's metrics and the benchmarks'
goodput."""

from __future__ import annotations

import pytest

from pdcluster.config.slo import meets_slo, time_per_output_token_s
from pdcluster.entrypoints.bench_client import RequestResult, summarize


@pytest.mark.parametrize(
    ("ttft_s", "tpot_s", "ttft_slo_ms", "tpot_slo_ms", "met"),
    [
        (0.5, 0.05, 1000.0, 100.0, True),  # both under
        (1.0, 0.1, 1000.0, 100.0, True),  # exactly at both targets: met (<=)
        (1.5, 0.05, 1000.0, 100.0, False),  # TTFT over
        (0.5, 0.2, 1000.0, 100.0, False),  # TPOT over
        (None, None, 1000.0, 100.0, False),  # no token arrived: no TTFT to meet a set target
        (0.5, None, 1000.0, 100.0, True),  # one output token: no TPOT to miss
        (None, 0.2, None, None, True),  # no targets: always met
        (9.0, 0.05, None, 100.0, True),  # only a TPOT target
        (0.5, 9.0, 1000.0, None, True),  # only a TTFT target
    ],
)
def test_meets_slo(ttft_s, tpot_s, ttft_slo_ms, tpot_slo_ms, met) -> None:
    assert meets_slo(ttft_s, tpot_s, ttft_slo_ms, tpot_slo_ms) is met


def test_goodput_counts_the_requests_meeting_the_slo() -> None:
    """summarize's goodput: 2 of 4 requests meet TTFT <= 1000 ms and TPOT <= 100 ms (one fails TTFT, one
    failed outright), over 2 s: 50% and 1 request/s."""

    def result(index: int, ok: bool, ttft_s: float | None, tpot_s: float | None) -> RequestResult:
        return RequestResult(
            index, 8, 4, 0.0, ok=ok, num_output_tokens=4, ttft_s=ttft_s, tpot_s=tpot_s, e2e_s=1.0
        )

    results = [
        result(0, True, 0.2, 0.05),
        result(1, True, 0.3, None),
        result(2, True, 1.2, 0.05),
        result(3, False, None, None),
    ]
    summary = summarize(results, duration_s=2.0, ttft_slo_ms=1000.0, tpot_slo_ms=100.0)
    assert summary["goodput_fraction"] == 0.5
    assert summary["goodput_requests_per_s"] == 1.0
    assert summary["num_failed"] == 1


@pytest.mark.parametrize(
    ("first_token_s", "last_token_s", "num_output_tokens", "tpot_s"),
    [
        (10.0, 13.0, 4, 1.0),  # 3 gaps over 3 s
        (10.0, 10.0, 1, None),  # one token: no TPOT
        (None, None, 0, None),  # no token arrived
        (2.0, 2.5, 2, 0.5),
    ],
)
def test_time_per_output_token_s(first_token_s, last_token_s, num_output_tokens, tpot_s) -> None:
    assert time_per_output_token_s(first_token_s, last_token_s, num_output_tokens) == tpot_s
