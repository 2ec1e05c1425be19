"""TPOT from token arrivals and the SLO attainment rule, shared by the API's metrics and the benchmarks."""

from __future__ import annotations

# default targets in milliseconds
DEFAULT_TTFT_SLO_MS = 1000.0
DEFAULT_TPOT_SLO_MS = 100.0


def time_per_output_token_s(
    first_token_s: float | None, last_token_s: float | None, num_output_tokens: int
) -> float | None:
    """(last token's arrival - first token's) / (num_output_tokens - 1) in seconds.

    None with fewer than 2 output tokens or a missing arrival time.
    """
    if first_token_s is None or last_token_s is None or num_output_tokens < 2:
        return None
    return (last_token_s - first_token_s) / (num_output_tokens - 1)


def meets_slo(
    ttft_s: float | None, tpot_s: float | None, ttft_slo_ms: float | None, tpot_slo_ms: float | None
) -> bool:
    """Whether one request met both SLOs (targets in ms; None: no target).

    False when a TTFT target is set and TTFT is missing or over it, or a measured TPOT is over its target.
    """
    if ttft_slo_ms is not None and (ttft_s is None or ttft_s * 1000 > ttft_slo_ms):
        return False
    return not (tpot_slo_ms is not None and tpot_s is not None and tpot_s * 1000 > tpot_slo_ms)
