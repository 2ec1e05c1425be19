"""Expert-parallel load balancer (EPLB): replica placement from measured expert load.

Our implementation of DeepSeek's published algorithm (github.com/deepseek-ai/EPLB; DeepSeek-V3 report,
arXiv 2412.19437, section 3.4): replicate the expert with the highest load per replica, then pack items
heaviest-first into the lightest bin with room. Hierarchical (groups onto nodes, then ranks) when
`num_groups % num_nodes == 0`, else global. Physical experts are numbered rank-major. Pure CPU functions.
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack items greedily into `num_packs` packs of `num_items // num_packs` items each.

    weight: [num_layers, num_items] load of each item
    returns pack_index, rank_in_pack: [num_layers, num_items] int64
    Raises ValueError if `num_items` is not a multiple of `num_packs`.
    """
    num_layers, num_items = weight.shape
    if num_packs < 1 or num_items % num_packs:
        raise ValueError(f"{num_items} items do not split evenly into {num_packs} packs")
    items_per_pack = num_items // num_packs
    pack_index = torch.empty(num_layers, num_items, dtype=torch.int64)
    rank_in_pack = torch.empty(num_layers, num_items, dtype=torch.int64)
    if items_per_pack == 1:
        pack_index[:] = torch.arange(num_items)
        rank_in_pack.zero_()
        return pack_index, rank_in_pack
    heaviest_first = weight.float().sort(dim=-1, descending=True, stable=True).indices
    for layer in range(num_layers):
        pack_load = [0.0] * num_packs
        pack_size = [0] * num_packs
        for item in heaviest_first[layer].tolist():
            open_packs = (p for p in range(num_packs) if pack_size[p] < items_per_pack)
            pack = min(open_packs, key=lambda p: (pack_load[p], p))
            pack_index[layer, item] = pack
            rank_in_pack[layer, item] = pack_size[pack]
            pack_load[pack] += float(weight[layer, item])
            pack_size[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(
    weight: torch.Tensor, num_physical: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give `num_physical - num_logical` extra replicas to the experts with the highest load per replica.

    weight: [num_layers, num_logical] load of each logical expert
    returns phy2log: [num_layers, num_physical] int64, logical expert of each physical expert
        replica_index: [num_layers, num_physical] int64, replica number of each physical expert
        logcnt: [num_layers, num_logical] int64, replicas per logical expert
    """
    num_layers, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical experts cannot hold {num_logical} logical ones")
    load = weight.float()
    layers = torch.arange(num_layers)
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(num_layers, 1)
    replica_index = torch.zeros(num_layers, num_physical, dtype=torch.int64)
    logcnt = torch.ones(num_layers, num_logical, dtype=torch.int64)
    for slot in range(num_logical, num_physical):
        hottest = (load / logcnt).max(dim=-1).indices
        phy2log[:, slot] = hottest
        replica_index[:, slot] = logcnt[layers, hottest]
        logcnt[layers, hottest] += 1
    return phy2log, replica_index, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm))
    return inv


def _rebalance_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes
    physical_per_rank = num_physical // num_ranks
    ranks_per_node = num_ranks // num_nodes

    # 1. Groups onto nodes (node-major logical order).
    group_load = weight.float().view(num_layers, num_groups, group_size).sum(-1)
    group_node, group_slot = balanced_packing(group_load, num_nodes)
    group_start = (group_node * groups_per_node + group_slot) * group_size
    log_to_nodemajor = (group_start[..., None] + torch.arange(group_size)).flatten(1)
    nodemajor_to_log = _inverse(log_to_nodemajor)

    # 2. Replicate within each node (each node's experts are a row of their own).
    node_load = weight.float().gather(1, nodemajor_to_log).view(num_layers * num_nodes, logical_per_node)
    phy_to_local, replica, local_cnt = replicate_experts(node_load, physical_per_node)

    # 3. Each node's physical experts onto its ranks, by load per replica.
    phy_load = (node_load / local_cnt).gather(1, phy_to_local)
    rank_of_phy, slot_of_phy = balanced_packing(phy_load, ranks_per_node)
    placed_to_phy = _inverse(rank_of_phy * physical_per_rank + slot_of_phy)

    placed_local = phy_to_local.gather(1, placed_to_phy).view(num_layers, num_nodes, physical_per_node)
    node_offset = (torch.arange(num_nodes) * logical_per_node).view(1, num_nodes, 1)
    placed_nodemajor = (placed_local + node_offset).flatten(1)
    phy2log = nodemajor_to_log.gather(1, placed_nodemajor)
    replica_index = replica.gather(1, placed_to_phy).view(num_layers, num_physical)
    logcnt = local_cnt.view(num_layers, num_logical).gather(1, log_to_nodemajor)
    return phy2log, replica_index, logcnt


def rebalance_experts(
    expert_load: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A placement of `num_physical_experts` replicas per layer on `num_ranks` ranks.

    expert_load: [num_layers, num_logical_experts] tokens routed to each logical expert
    returns phy2log: [num_layers, num_physical_experts] int64, logical expert id of each physical expert
        log2phy: [num_layers, num_logical_experts, num_physical - num_logical + 1] int64, -1 padded
        logcnt: [num_layers, num_logical_experts] int64, replicas of each logical expert
    Raises ValueError for counts that do not divide as required or a load tensor that is not 2-D.
    """
    if expert_load.dim() != 2:
        raise ValueError(
            f"expert_load must be [num_layers, num_logical_experts], got {tuple(expert_load.shape)}"
        )
    num_layers, num_logical = expert_load.shape
    if num_physical_experts < num_logical:
        raise ValueError(f"num_physical_experts {num_physical_experts} < num_logical_experts {num_logical}")
    if num_ranks < 1 or num_physical_experts % num_ranks:
        raise ValueError(
            f"num_physical_experts {num_physical_experts} is not a multiple of num_ranks {num_ranks}"
        )
    if num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"num_groups {num_groups} does not divide num_logical_experts {num_logical}")
    hierarchical = (
        num_nodes >= 1
        and num_groups % num_nodes == 0
        and num_ranks % num_nodes == 0
        and num_physical_experts % num_nodes == 0
    )
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    phy2log, replica_index, logcnt = _rebalance_hierarchical(
        expert_load, num_physical_experts, num_groups, num_nodes, num_ranks
    )
    max_replicas = num_physical_experts - num_logical + 1
    log2phy = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
    log2phy.scatter_(
        1,
        phy2log * max_replicas + replica_index,
        torch.arange(num_physical_experts, dtype=torch.int64).expand(num_layers, -1),
    )
    return phy2log, log2phy.view(num_layers, num_logical, max_replicas), logcnt
