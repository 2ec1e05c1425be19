"""Prometheus families of the expert-parallel figures each EP rank reports (`stats()["ranks"][*]["ep"]`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (family name, kind, help, EPStats field) of the families with the rank as their only label
_PER_RANK = (
    ("pdcluster_ep_steps", "counter", "Engine steps the EP rank ran in lockstep.", "num_steps"),
    (
        "pdcluster_ep_idle_steps",
        "counter",
        "Lockstep steps the rank joined with no request.",
        "num_idle_steps",
    ),
    (
        "pdcluster_ep_total_imbalance",
        "gauge",
        "Max / mean rows per rank over all MoE layers.",
        "total_imbalance",
    ),
    ("pdcluster_ep_rebalances", "counter", "EPLB rebalances of the rank's instance.", "num_rebalances"),
    ("pdcluster_ep_rebalance_seconds", "counter", "Seconds the rank spent rebalancing.", "rebalance_s"),
    ("pdcluster_ep_last_rebalance_seconds", "gauge", "Duration of the last rebalance.", "last_rebalance_s"),
    (
        "pdcluster_ep_rebalance_moved_bytes",
        "counter",
        "Expert-weight bytes the rank received in rebalances.",
        "rebalance_moved_bytes",
    ),
)
_SECONDS = (("dispatch", "dispatch_s"), ("combine", "combine_s"), ("expert", "expert_s"))
_BYTES = (("dispatch", "dispatch_bytes"), ("combine", "combine_bytes"), ("counts", "counts_bytes"))


def _family(name: str, kind: str, doc: str, labels: list[str]) -> GaugeMetricFamily | CounterMetricFamily:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, doc, labels=labels)


def ep_metrics(ranks: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The families above for every rank of `ranks` (`stats()["ranks"]`) that reports `ep` figures."""
    ep = {name: r["ep"] for name, r in sorted(ranks.items()) if r.get("ep")}
    if not ep:
        return
    for name, kind, doc, key in _PER_RANK:
        family = _family(name, kind, doc, ["rank"])
        for rank, stats in ep.items():
            family.add_metric([rank], stats[key])
        yield family
    seconds = CounterMetricFamily(
        "pdcluster_ep_seconds", "Seconds in EP dispatch / combine / local experts.", labels=["rank", "phase"]
    )
    sent = CounterMetricFamily(
        "pdcluster_ep_bytes", "Bytes the rank sent to other ranks in EP collectives.", labels=["rank", "kind"]
    )
    imbalance = GaugeMetricFamily(
        "pdcluster_ep_imbalance", "Max / mean rows per rank of one MoE layer.", labels=["rank", "layer"]
    )
    load = GaugeMetricFamily(
        "pdcluster_ep_expert_load",
        "(token, expert) pairs of the rank per logical expert over the EPLB window.",
        labels=["rank", "layer", "expert"],
    )
    for rank, stats in ep.items():
        for phase, key in _SECONDS:
            seconds.add_metric([rank, phase], stats[key])
        for kind, key in _BYTES:
            sent.add_metric([rank, kind], stats[key])
        for layer, value, experts in zip(
            stats["moe_layers"], stats["imbalance"], stats["expert_load"], strict=True
        ):
            imbalance.add_metric([rank, str(layer)], value)
            for expert, pairs in enumerate(experts):
                load.add_metric([rank, str(layer), str(expert)], pairs)
    yield from (seconds, sent, imbalance, load)


_PER_INSTANCE = (
    ("pdcluster_instance_live_ranks", "gauge", "Ranks the instance serves on now.", "ranks"),
    ("pdcluster_instance_deployed_ranks", "gauge", "Ranks the instance was deployed with.", "deployed_ranks"),
    ("pdcluster_instance_degraded", "gauge", "1 while it serves on fewer ranks than deployed.", "degraded"),
    ("pdcluster_instance_recoveries", "counter", "Times it shrank onto its surviving ranks.", "recoveries"),
    ("pdcluster_instance_rejoins", "counter", "Times replacement ranks joined it.", "rejoins"),
)


def instance_metrics(instances: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Elastic EP figures per instance (`stats()["instances"]`, `driver.registry.InstanceRegistry.health`)."""
    if not instances:
        return
    for name, kind, doc, key in _PER_INSTANCE:
        family = _family(name, kind, doc, ["instance"])
        for instance, health in sorted(instances.items()):
            if key in health:
                family.add_metric([instance], float(health[key]))
        yield family
