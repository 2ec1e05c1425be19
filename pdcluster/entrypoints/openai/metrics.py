"""Prometheus metrics of one API server (`GET /metrics`), in a registry owned by the app."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdcluster.config.slo import meets_slo
from pdcluster.entrypoints.openai.ep_metrics import ep_metrics, instance_metrics

if TYPE_CHECKING:
    from pdcluster.config import SLOConfig
    from pdcluster.driver.backend import StreamDelta

# Buckets in seconds: TTFT spans a queued long prompt on a CPU; TPOT/ITL are per-step gaps.
_TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _BackendStatsCollector(Collector):
    """Gauges read from `backend.stats()` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        """Nothing, so registering the collector does not call `stats()` (a stalled cluster would block)."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the backend is down
            return
        for key, name, doc in (
            ("num_waiting_requests", "pdcluster_num_requests_waiting", "Requests queued (all instances)."),
            ("num_running_requests", "pdcluster_num_requests_running", "Requests running (all instances)."),
        ):
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=stats[key])
        kv_blocks = stats.get("kv_blocks") or {}
        if kv_blocks:
            used = GaugeMetricFamily(
                "pdcluster_kv_cache_used_blocks", "KV cache blocks held by requests.", labels=["instance"]
            )
            total = GaugeMetricFamily(
                "pdcluster_kv_cache_total_blocks", "KV cache blocks of the instance.", labels=["instance"]
            )
            usage = GaugeMetricFamily(
                "pdcluster_kv_cache_usage_ratio", "Fraction of KV cache blocks held.", labels=["instance"]
            )
            for instance, blocks in sorted(kv_blocks.items()):
                num_used, num_total = blocks["num_used_blocks"], blocks["num_total_blocks"]
                used.add_metric([instance], num_used)
                total.add_metric([instance], num_total)
                usage.add_metric([instance], num_used / num_total if num_total else 0.0)
            yield from (used, total, usage)
        yield from _rank_gauges(stats.get("ranks") or {})
        yield from ep_metrics(stats.get("ranks") or {})
        yield from instance_metrics(stats.get("instances") or {})
        if "kv_transfer_bytes_total" in stats:
            yield CounterMetricFamily(
                "pdcluster_backend_kv_transfer_bytes",
                "KV bytes moved prefill -> decode, as counted by the backend.",
                value=stats["kv_transfer_bytes_total"],
            )
        if "requests_recomputed_total" in stats:  # re-dispatched after a lost decode (driver.recompute)
            yield CounterMetricFamily(
                "pdcluster_requests_recomputed",
                "Requests re-dispatched with their streamed tokens kept after decode lost their KV.",
                value=stats["requests_recomputed_total"],
            )
            yield CounterMetricFamily(
                "pdcluster_recomputed_tokens",
                "Streamed output tokens whose KV such re-dispatches computed again.",
                value=stats["recomputed_tokens_total"],
            )
        if "kv_transfer_seconds_total" in stats:
            yield CounterMetricFamily(
                "pdcluster_backend_kv_transfer_seconds",
                "Seconds spent in KV transfer, as counted by the backend.",
                value=stats["kv_transfer_seconds_total"],
            )


_RANK_COUNTER_DOCS = {
    "num_free_blocks": "KV cache blocks free on the rank.",
    "num_total_blocks": "KV cache blocks of the rank.",
    "num_running": "Requests in the rank's running batch.",
    "num_reserved": "Reservations on the rank waiting for their KV handoff.",
    "num_waiting_for_seat": "Requests received on the rank, waiting for a seat in its batch.",
    "num_queued_prefill_tokens": "Prompt tokens queued or being prefilled on the rank.",
    "num_requests": "Prefill requests in flight on the rank.",
    "num_engine_errors": "Exceptions the rank's engine thread survived.",
}


def _rank_gauges(ranks: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """`pdcluster_rank_<counter>{rank}` for every counter some rank reports (`_RANK_COUNTER_DOCS`)."""
    for counter, doc in _RANK_COUNTER_DOCS.items():
        reported = {name: r[counter] for name, r in ranks.items() if counter in r}
        if not reported:
            continue
        gauge = GaugeMetricFamily(f"pdcluster_rank_{counter}", doc, labels=["rank"])
        for name, value in sorted(reported.items()):
            gauge.add_metric([name], value)
        yield gauge


class ApiMetrics:
    """The metrics of one app (see the module docstring); `registry` is what `/metrics` exposes."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(f"pdcluster_{name}", doc, labels, buckets=buckets, registry=r)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"pdcluster_{name}", doc, labels, registry=r)

        self.ttft_s = histogram(
            "time_to_first_token_seconds", "Arrival at the API server -> first token.", _TTFT_BUCKETS_S
        )
        self.tpot_s = histogram(
            "time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (output tokens - 1).",
            _TPOT_BUCKETS_S,
        )
        self.itl_s = histogram(
            "inter_token_latency_seconds",
            "Gap between successive token deltas of a request.",
            _TPOT_BUCKETS_S,
        )
        self.e2e_s = histogram(
            "e2e_request_latency_seconds", "Arrival at the API server -> last token.", _E2E_BUCKETS_S
        )
        self.phase_s = histogram(
            "request_phase_seconds",
            "Per-request phase durations reported by the backend.",
            _E2E_BUCKETS_S,
            "phase",
        )
        self.kv_transfer_s = histogram(
            "kv_transfer_seconds", "Per-request KV transfer time prefill -> decode.", _TPOT_BUCKETS_S
        )
        self.kv_transfer_bytes = counter(
            "kv_transfer_bytes", "KV bytes moved prefill -> decode (per-request phases)."
        )
        per_position = "per draft position (0 = first draft)."
        self.num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", f"MTP draft tokens proposed, {per_position}", "position"
        )
        self.num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", f"MTP draft tokens accepted, {per_position}", "position"
        )
        self.requests = counter("requests", "Finished requests by finish reason.", "finish_reason")
        self.errors = counter("request_errors", "Requests answered with an error.", "status_code")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of served requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.in_flight = Gauge(
            "pdcluster_requests_in_flight",
            "Completion requests admitted at the HTTP edge whose response has not ended.",
            registry=r,
        )
        self.slo_requests = counter(
            "slo_requests",
            "Finished requests by whether they met both the TTFT and the TPOT SLO.",
            "attained",
        )
        r.register(_BackendStatsCollector(stats))

    def record_request(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        extension: dict[str, Any],
        last: StreamDelta | None,
        slo: SLOConfig | None,
    ) -> None:
        """Count one ended request; an aborted one only in `requests{finish_reason="abort"}`.

        extension: the response's `pdcluster` field (`Generation.extension()`): ttft_s, tpot_s, e2e_s
            in seconds, `phases` (names ending in `_s` are seconds, `kv_transfer_bytes` bytes).
        """
        self.requests.labels(finish_reason).inc()
        if finish_reason == "abort":
            return
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if extension["ttft_s"] is not None:
            self.ttft_s.observe(extension["ttft_s"])
        if extension["tpot_s"] is not None:
            self.tpot_s.observe(extension["tpot_s"])
        self.e2e_s.observe(extension["e2e_s"])
        phases = extension["phases"]
        for name, value in phases.items():
            if name.endswith("_s"):
                self.phase_s.labels(name.removesuffix("_s")).observe(value)
        if "kv_transfer_s" in phases:
            self.kv_transfer_s.observe(phases["kv_transfer_s"])
        if "kv_transfer_bytes" in phases:
            self.kv_transfer_bytes.inc(phases["kv_transfer_bytes"])
        if last is not None:
            for i, n in enumerate(last.drafts.num_draft_tokens_per_position):
                self.num_draft_tokens.labels(str(i)).inc(n)
            for i, n in enumerate(last.drafts.num_accepted_tokens_per_position):
                self.num_accepted_tokens.labels(str(i)).inc(n)
        if slo is not None and (slo.ttft_ms is not None or slo.tpot_ms is not None):
            attained = meets_slo(extension["ttft_s"], extension["tpot_s"], slo.ttft_ms, slo.tpot_ms)
            self.slo_requests.labels(str(attained).lower()).inc()
