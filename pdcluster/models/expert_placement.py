"""Which physical expert (replica of a routed expert) lives on which EP rank, for every MoE layer.

Rank-major numbering: rank r holds physical experts `r * num_local_experts ..` as local slots 0, 1, ...
Rows are MoE layers in model order (`moe_layer_indices`), MTP layers included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.models.config import DeepseekV3Config


def moe_layer_indices(config: DeepseekV3Config) -> list[int]:
    num_layers = config.num_hidden_layers + config.num_nextn_predict_layers
    return [i for i in range(num_layers) if config.is_moe_layer(i)]


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Placement of routed-expert replicas on EP ranks.

    phy2log: [num_moe_layers, num_physical_experts] int64, logical expert id of each physical expert
    log2phy: [num_moe_layers, num_logical_experts, max_replicas] int64, physical ids, -1 padded
    logcnt: [num_moe_layers, num_logical_experts] int64, replicas of each logical expert (>= 1)
    Raises ValueError for inconsistent shapes, an unplaced expert, or physical experts not divisible by ranks.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_ranks: int

    def __post_init__(self) -> None:
        num_layers, num_physical = self.phy2log.shape
        if self.num_ranks < 1 or num_physical % self.num_ranks:
            raise ValueError(
                f"{num_physical} physical experts do not split evenly over {self.num_ranks} EP ranks "
                "(num_logical_experts + num_redundant_experts must be a multiple of expert_parallel_size)"
            )
        if self.log2phy.shape[:2] != self.logcnt.shape or self.logcnt.shape[0] != num_layers:
            raise ValueError(
                f"placement maps disagree: phy2log {tuple(self.phy2log.shape)}, log2phy "
                f"{tuple(self.log2phy.shape)}, logcnt {tuple(self.logcnt.shape)}"
            )
        if (self.logcnt < 1).any():
            raise ValueError("every logical expert needs at least one physical replica (logcnt >= 1)")

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_logical_experts: int, num_ranks: int) -> ExpertPlacement:
        phy2log = phy2log.to(torch.int64)
        num_layers, num_physical = phy2log.shape
        logcnt = torch.zeros(num_layers, num_logical_experts, dtype=torch.int64)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        max_replicas = num_physical - num_logical_experts + 1  # as `rebalance_experts` pads it
        log2phy = torch.full((num_layers, num_logical_experts, max_replicas), -1, dtype=torch.int64)
        seen = torch.zeros_like(logcnt)
        for layer in range(num_layers):
            for phy, log in enumerate(phy2log[layer].tolist()):
                log2phy[layer, log, seen[layer, log]] = phy
                seen[layer, log] += 1
        return cls(phy2log, log2phy, logcnt, num_ranks)

    @classmethod
    def default(
        cls, num_moe_layers: int, num_logical_experts: int, num_ranks: int, num_redundant_experts: int = 0
    ) -> ExpertPlacement:
        """Before any load is known: physical p < num_logical holds expert p, redundant i `i % num_logical`.

        Raises ValueError for num_redundant_experts < 0 or physical experts not divisible by ranks.
        """
        if num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
        row = list(range(num_logical_experts)) + [
            i % num_logical_experts for i in range(num_redundant_experts)
        ]
        phy2log = torch.tensor([row] * num_moe_layers, dtype=torch.int64).view(num_moe_layers, len(row))
        return cls.from_phy2log(phy2log, num_logical_experts, num_ranks)

    @property
    def num_moe_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical_experts(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical_experts(self) -> int:
        return self.logcnt.shape[1]

    @property
    def num_local_experts(self) -> int:
        return self.num_physical_experts // self.num_ranks

    def local_physical_experts(self, rank: int) -> range:
        n = self.num_local_experts
        return range(rank * n, (rank + 1) * n)

    def local_logical_experts(self, row: int, rank: int) -> list[int]:
        phys = self.local_physical_experts(rank)
        return self.phy2log[row, phys.start : phys.stop].tolist()

    def rank_loads(self, expert_load: torch.Tensor) -> torch.Tensor:
        """Rows per rank [num_moe_layers, num_ranks] float32, an expert's load split over its replicas."""
        per_replica = expert_load.float() / self.logcnt
        return per_replica.gather(1, self.phy2log).view(self.num_moe_layers, self.num_ranks, -1).sum(-1)
