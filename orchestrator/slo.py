"""The SLO attainment rule, one place for the API's metrics (`pdcluster_slo_requests_total`) and the
benchmarks' goodput (`orchestrator.bench_client.summarize`, `pdcluster bench`, `pdcluster demo`,
`python -m orchestrator.job`)."""

from __future__ import annotations

# the targets `pdcluster bench` and the topology-driven jobs use where none is set (milliseconds)
DEFAULT_TTFT_SLO_MS = 1000.0
DEFAULT_TPOT_SLO_MS = 100.0


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
