"""Seconds of EP dispatch/combine in one engine step, and the slowest EP rank's load.

Without node forwarding each (token, expert) pair crosses the EP link (DeepEP low-latency kernels, DeepEP
README); with it a token crosses nodes once per destination node, then the intra-node link (DeepSeek-V3
report, arXiv:2412.19437, section 3.2.2). A rank's time is the larger of its sent and received bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcluster.models.config import DeepseekV3Config


@dataclass(frozen=True)
class Link:
    """One link level: `bandwidth_bytes_per_s` per device per direction, `latency_s`, `level`."""

    bandwidth_bytes_per_s: float
    latency_s: float
    level: str = "intra_node"


def statistical_imbalance(pairs_per_rank: float, ep: int) -> float:
    """Max of `ep` Poisson loads of mean `mu` over the mean: `1 + sqrt(2 ln(ep) / mu)`; 1 for ep 1."""
    if ep <= 1 or pairs_per_rank <= 0:
        return 1.0
    return 1.0 + math.sqrt(2.0 * math.log(ep) / pairs_per_rank)


def ep_layer_s(
    config: DeepseekV3Config,
    ep: int,
    t_rank: float,
    pairs: float,
    imbalance: float,
    bytes_per_element: int,
    link: Link,
    efficiency: float,
    node_forwarding: tuple[int, Link] | None = None,
) -> float:
    """Dispatch + combine seconds of one MoE layer on the slowest EP rank: `t_rank` tokens sent, `pairs`
    received, `bytes_per_element` of dispatch + combine (e.g. fp8 + bf16 = 3)."""
    k = config.num_experts_per_tok
    per_token = config.hidden_size * bytes_per_element
    if node_forwarding is None or ep <= node_forwarding[0]:
        traffic = max(t_rank * k, pairs) * per_token * (ep - 1) / ep
        return traffic / (link.bandwidth_bytes_per_s * efficiency) + 2 * link.latency_s
    per_node, intra = node_forwarding
    nodes = math.ceil(ep / per_node)
    # destination nodes of a token's k experts, capped by node-limited routing
    distinct = nodes * (1.0 - (1.0 - 1.0 / nodes) ** k)
    if config.n_group > 1:
        distinct = min(distinct, config.topk_group * max(1.0, nodes / config.n_group))
    inter = t_rank * distinct * (nodes - 1) / nodes * per_token * imbalance
    local = t_rank * k * (per_node - 1) / per_node * per_token * imbalance
    seconds = max(inter / link.bandwidth_bytes_per_s, local / intra.bandwidth_bytes_per_s) / efficiency
    return seconds + 2 * (link.latency_s + intra.latency_s)
