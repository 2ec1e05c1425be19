"""TPOT as measured from token arrivals and the SLO attainment rule, one place for the API's metrics
(`pdcluster_time_per_output_token_seconds`, `pdcluster_slo_requests_total`, the `pdcluster` response field)
and the benchmarks (`orchestrator.bench_client`: `pdcluster bench`, `pdcluster demo`;
`python -m pdcluster.orchestrator.job`)."""

from __future__ import annotations

# the targets `pdcluster bench` and the topology-driven jobs use where none is set (milliseconds)
DEFAULT_TTFT_SLO_MS = 1000.0
DEFAULT_TPOT_SLO_MS = 100.0


def time_per_output_token_s(
    first_token_s: float | None, last_token_s: float | None, num_output_tokens: int
) -> float | None:
    """TPOT in seconds: (last token's arrival - first token's) / (num_output_tokens - 1).

    Args:
        first_token_s, last_token_s: arrival times (seconds, one clock) of the first and the last output
            token; None: no token arrived.

    Returns:
        None with fewer than 2 output tokens or no arrival time (no TPOT to measure).
    """
    if first_token_s is None or last_token_s is None or num_output_tokens < 2:
        return None
    return (last_token_s - first_token_s) / (num_output_tokens - 1)


def meets_slo(
    ttft_s: float | None, tpot_s: float | None, ttft_slo_ms: float | None, tpot_slo_ms: float | None
) -> bool:
    """Whether one request met both SLOs.

    Args:
        ttft_s, tpot_s: the request's TTFT and TPOT in seconds; None: not measured (no token arrived, or
            one output token: no TPOT).
        ttft_slo_ms, tpot_slo_ms: the targets in milliseconds; None: no target (always met).

    Returns:
        False when a TTFT target is set and TTFT was not measured or is over it, or a TPOT target is set and
        a measured TPOT is over it (a request with one output token has no TPOT to miss); else True.
    """
    if ttft_slo_ms is not None and (ttft_s is None or ttft_s * 1000 > ttft_slo_ms):
        return False
    return not (tpot_slo_ms is not None and tpot_s is not None and tpot_s * 1000 > tpot_slo_ms)
