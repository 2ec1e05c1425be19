"""How much more than the mean the slowest rank of a step carries: EP ranks after EPLB, DP attention ranks.

EP: DeepSeek's EPLB (`models.eplb.rebalance_experts`) places replicas by lognormal long-run popularity; a
step of S requests deviates per expert by `sqrt(exp(sigma^2) - 1) / sqrt(S)` (seeded normal draws).
DP attention: the slowest of dp ranks holds about `mean + sqrt(2 ln dp) sd sqrt(n)` KV tokens for n rows
per rank (normal approximation of the maximum of dp sums).
"""

from __future__ import annotations

import functools
import math
import random
from statistics import NormalDist


@functools.lru_cache(maxsize=256)
def eplb_imbalance(
    num_logical: int,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    popularity_sigma: float,
    routing_sigma: float = 0.0,
    num_sequences: int = 0,
    num_draws: int = 16,
) -> float:
    """Most loaded EP rank over the mean in a step of `num_sequences` requests after EPLB (0: long-run loads).
    Raises ValueError for counts `models.eplb.rebalance_experts` refuses."""
    import torch

    from pdcluster.models.eplb import rebalance_experts

    if num_ranks <= 1:
        return 1.0
    num_physical -= num_physical % num_ranks
    if num_physical < num_logical:
        return 1.0
    normal = NormalDist()
    loads = [math.exp(popularity_sigma * normal.inv_cdf((i + 0.5) / num_logical)) for i in range(num_logical)]
    random.Random(0).shuffle(loads)
    popularity = torch.tensor([loads], dtype=torch.float64)
    phy2log, _, logcnt = rebalance_experts(popularity, num_physical, num_groups, num_nodes, num_ranks)
    spread = math.sqrt(math.expm1(routing_sigma**2) / num_sequences) if num_sequences else 0.0
    generator = torch.Generator().manual_seed(0)
    draws = 1 if spread == 0 else num_draws
    deviation = 1.0 + spread * torch.randn(draws, num_logical, generator=generator, dtype=torch.float64)
    step = popularity * deviation.clamp(min=0.0)  # [draws, num_logical]
    per_replica = (step / logcnt[0])[:, phy2log[0]]  # [draws, num_physical]
    rank_load = per_replica.view(draws, num_ranks, -1).sum(dim=2)
    return float((rank_load.max(dim=1).values / rank_load.mean(dim=1)).mean())


def dp_max_rank_kv_factor(num_rows: int, dp: int, kv_sum: float, kv_sq_sum: float) -> float:
    """Slowest DP rank's KV tokens over the mean, `num_rows` spread evenly over `dp` ranks; >= 1."""
    if dp <= 1 or num_rows <= dp or kv_sum <= 0:
        return 1.0
    mean = kv_sum / num_rows
    var = max(kv_sq_sum / num_rows - mean * mean, 0.0)
    per_rank = num_rows / dp
    factor = 1.0 + math.sqrt(2.0 * math.log(dp)) * math.sqrt(var) / (mean * math.sqrt(per_rank))
    return min(factor, per_rank)
