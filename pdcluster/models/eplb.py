"""Expert-parallel load balancer (EPLB): where each routed expert's replicas go, from measured expert load.

Our implementation of the algorithm DeepSeek published with DeepSeek-V3 (github.com/deepseek-ai/EPLB,
README "Hierarchical Load Balancing" / "Global Load Balancing"; DeepSeek-V3 report, arXiv 2412.19437,
section 3.4 "redundant experts"):

1. **Replication.** With `num_physical_experts - num_logical_experts` redundant slots, repeatedly give one
   more replica to the logical expert whose load per replica is highest.
2. **Balanced packing.** Place items (groups, or physical experts) on bins (nodes, or ranks) with the same
   number of items per bin: heaviest item first, each into the lightest bin that still has room.

*Hierarchical* (used when `num_groups % num_nodes == 0`): expert groups are packed onto nodes first (the
group-limited routing of DeepSeek-V3 then keeps a token's experts on few nodes), then experts are
replicated within each node, then the node's physical experts are packed onto its ranks. Otherwise
*global*: replication over all experts, then packing onto all ranks (the hierarchical procedure with one
group and one node).

Physical experts are numbered rank-major: physical expert `p` lives on rank `p // (num_physical_experts //
num_ranks)`. Every function here is a pure tensor function on CPU tensors.
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack `num_items` weighted items into `num_packs` packs of exactly `num_items // num_packs` items,
    greedily (heaviest first, into the lightest pack with room).

    Args:
        weight: `[num_layers, num_items]` float (or int) load of each item; each layer is packed alone.
        num_packs: packs per layer; must divide `num_items`.

    Returns:
        `(pack_index [num_layers, num_items] int64, rank_in_pack [num_layers, num_items] int64)`: the pack
        of each item and its slot within the pack (0 .. items_per_pack - 1).

    Raises:
        ValueError: `num_items` not a multiple of `num_packs`.
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
    """Give `num_physical - num_logical` extra replicas, one at a time, to the logical expert with the
    highest load per replica.

    Args:
        weight: `[num_layers, num_logical]` load of each logical expert.
        num_physical: physical experts (replicas) per layer, >= num_logical.

    Returns:
        `phy2log [num_layers, num_physical]` int64: the logical expert of each physical one (the first
        num_logical are the logical experts themselves, in order); `replica_index [num_layers,
        num_physical]` int64: which replica of its logical expert each physical one is (0-based);
        `logcnt [num_layers, num_logical]` int64: replicas per logical expert.
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
        hottest = (load / logcnt).max(dim=-1).indices  # [num_layers]; ties: the lowest expert id
        phy2log[:, slot] = hottest
        replica_index[:, slot] = logcnt[layers, hottest]
        logcnt[layers, hottest] += 1
    return phy2log, replica_index, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Inverse of each row's permutation: `out[l, perm[l, i]] = i`."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm))
    return inv


def _rebalance_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(phy2log, replica_index, logcnt)` as in `replicate_experts`, physical experts rank-major."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes
    physical_per_rank = num_physical // num_ranks
    ranks_per_node = num_ranks // num_nodes

    # 1. Groups onto nodes. "Node-major" logical order: node n holds node-major ids
    #    [n * logical_per_node, (n + 1) * logical_per_node).
    group_load = weight.float().view(num_layers, num_groups, group_size).sum(-1)
    group_node, group_slot = balanced_packing(group_load, num_nodes)  # [L, num_groups]
    group_start = (group_node * groups_per_node + group_slot) * group_size  # node-major id of its 1st expert
    log_to_nodemajor = (group_start[..., None] + torch.arange(group_size)).flatten(1)  # [L, num_logical]
    nodemajor_to_log = _inverse(log_to_nodemajor)

    # 2. Replicate within each node (each node's experts are a row of their own).
    node_load = weight.float().gather(1, nodemajor_to_log).view(num_layers * num_nodes, logical_per_node)
    phy_to_local, replica, local_cnt = replicate_experts(node_load, physical_per_node)

    # 3. Each node's physical experts onto its ranks, by load per replica.
    phy_load = (node_load / local_cnt).gather(1, phy_to_local)
    rank_of_phy, slot_of_phy = balanced_packing(phy_load, ranks_per_node)
    placed_to_phy = _inverse(rank_of_phy * physical_per_rank + slot_of_phy)  # rank-major within the node

    placed_local = phy_to_local.gather(1, placed_to_phy).view(num_layers, num_nodes, physical_per_node)
    node_offset = (torch.arange(num_nodes) * logical_per_node).view(1, num_nodes, 1)
    placed_nodemajor = (placed_local + node_offset).flatten(1)  # [L, num_physical]
    phy2log = nodemajor_to_log.gather(1, placed_nodemajor)
    replica_index = replica.gather(1, placed_to_phy).view(num_layers, num_physical)
    logcnt = local_cnt.view(num_layers, num_logical).gather(1, log_to_nodemajor)
    return phy2log, replica_index, logcnt


def rebalance_experts(
    expert_load: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A placement of `num_physical_experts` expert replicas per layer on `num_ranks` ranks.

    Args:
        expert_load: `[num_layers, num_logical_experts]` load (tokens routed) of each logical expert, any
            real dtype; only ratios within a layer matter.
        num_physical_experts: replicas per layer (num_logical_experts + redundant experts); a multiple
            of num_ranks.
        num_groups: expert groups (the model's `n_group`); must divide num_logical_experts.
        num_nodes: server nodes; hierarchical balancing when `num_groups % num_nodes == 0` (and ranks
            split evenly over nodes), otherwise global.
        num_ranks: EP ranks (devices), rank-major physical numbering (`num_physical_experts // num_ranks`
            consecutive physical experts per rank).

    Returns:
        `phy2log [num_layers, num_physical_experts]` int64: logical expert id of each physical expert;
        `log2phy [num_layers, num_logical_experts, max_replicas]` int64: the physical ids of each logical
        expert's replicas, -1 padded (`max_replicas = num_physical - num_logical + 1`);
        `logcnt [num_layers, num_logical_experts]` int64: replicas of each logical expert (>= 1).

    Raises:
        ValueError: a count that does not divide as required, or a load tensor that is not 2-D.
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
