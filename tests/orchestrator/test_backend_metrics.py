"""/metrics families read from `backend.stats()` at scrape time: the backend's own totals."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdcluster.entrypoints.openai.metrics import ApiMetrics


def _scrape(stats: dict) -> str:
    return generate_latest(ApiMetrics(lambda: stats).registry).decode()


def test_backend_totals_reach_metrics() -> None:
    text = _scrape({"kv_transfer_bytes_total": 4096, "kv_transfer_seconds_total": 0.25})
    assert "pdcluster_backend_kv_transfer_bytes_total 4096.0" in text
    assert "pdcluster_backend_kv_transfer_seconds_total 0.25" in text


def test_a_backend_without_the_totals_exports_none_of_them() -> None:
    text = _scrape({})
    assert "pdcluster_backend_" not in text


def test_re_dispatches_after_a_lost_decode_reach_metrics() -> None:
    text = _scrape({"requests_recomputed_total": 3, "recomputed_tokens_total": 41})
    assert "pdcluster_requests_recomputed_total 3.0" in text
    assert "pdcluster_recomputed_tokens_total 41.0" in text
    assert "pdcluster_requests_recomputed" not in _scrape({})
