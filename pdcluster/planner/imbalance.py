"""How much more than the mean the slowest rank of a step carries: EP ranks after EPLB, DP attention ranks.

* EP: expert popularity, lognormal with spread `popularity_sigma` (deterministic quantiles), is placed by
  `models.eplb.rebalance_experts` (DeepSeek's EPLB) onto the EP ranks with the redundant experts; the
  static imbalance is the most loaded rank over the mean. EPLB balances expected loads only: a request
  prefers its own experts (its tokens route alike), a lognormal spread `routing_sigma` per expert, so a
  step of `S` requests deviates per expert by `sqrt(exp(sigma^2) - 1) / sqrt(S)`, a rank of `e` local
  experts by that over `sqrt(e)`, and the most loaded of `ep` ranks sits `sqrt(2 ln ep)` of them above
  the mean (`routing_noise_imbalance`). Finite tokens add Poisson noise (`comm_costs.statistical_imbalance`).
* DP attention: decode requests are spread over the ranks in equal numbers, but their KV lengths differ;
  the slowest rank holds about `mean + sqrt(2 ln dp) x sd x sqrt(n)` KV tokens for `n` requests per rank
  (normal approximation of the maximum of `dp` sums).
"""

from __future__ import annotations

import functools
import math
import random
from statistics import NormalDist


@functools.lru_cache(maxsize=64)
def eplb_static_imbalance(
    num_logical: int,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    popularity_sigma: float,
) -> float:
    """Most loaded EP rank over the mean after EPLB places `num_physical` replicas of `num_logical` experts
    whose loads follow a lognormal of spread `popularity_sigma` (0: uniform -> 1.0).

    Raises:
        ValueError: counts `models.eplb.rebalance_experts` refuses.
    """
    import torch

    from pdcluster.models.eplb import rebalance_experts

    if num_ranks <= 1 or popularity_sigma <= 0:
        return 1.0
    if num_physical % num_ranks:  # EPLB needs whole experts per rank: round the replicas down
        num_physical = max(num_ranks, num_physical - num_physical % num_ranks)
    if num_physical < num_logical:
        return 1.0
    normal = NormalDist()
    loads = [math.exp(popularity_sigma * normal.inv_cdf((i + 0.5) / num_logical)) for i in range(num_logical)]
    random.Random(0).shuffle(loads)
    load = torch.tensor([loads], dtype=torch.float64)
    phy2log, _, logcnt = rebalance_experts(load, num_physical, num_groups, num_nodes, num_ranks)
    per_replica = (load[0] / logcnt[0])[phy2log[0]]
    rank_load = per_replica.view(num_ranks, -1).sum(dim=1)
    return float(rank_load.max() / rank_load.mean())


def routing_noise_imbalance(ep: int, local_experts: float, routing_sigma: float, num_sequences: int) -> float:
    """Most loaded of `ep` ranks over the mean in a step of `num_sequences` requests, each preferring its
    experts with lognormal spread `routing_sigma`, `local_experts` per rank (module docstring); 1 for
    ep <= 1 or no requests."""
    if ep <= 1 or routing_sigma <= 0 or num_sequences <= 0:
        return 1.0
    cv = math.sqrt(math.expm1(routing_sigma * routing_sigma) / max(local_experts, 1.0) / num_sequences)
    return 1.0 + math.sqrt(2.0 * math.log(ep)) * cv


def dp_max_rank_kv_factor(num_rows: int, dp: int, kv_sum: float, kv_sq_sum: float) -> float:
    """Slowest DP rank's KV tokens over the mean rank's when `num_rows` requests of KV lengths with sum
    `kv_sum` and sum of squares `kv_sq_sum` are spread evenly over `dp` ranks (module docstring); >= 1."""
    if dp <= 1 or num_rows <= dp or kv_sum <= 0:
        return 1.0
    mean = kv_sum / num_rows
    var = max(kv_sq_sum / num_rows - mean * mean, 0.0)
    per_rank = num_rows / dp
    factor = 1.0 + math.sqrt(2.0 * math.log(dp)) * math.sqrt(var) / (mean * math.sqrt(per_rank))
    return min(factor, per_rank)
