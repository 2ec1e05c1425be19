"""Placement: which node and devices each prefill/decode instance gets, as plain data for Ray.

`plan_placement` is pure: node-spanning instances first (whole consecutive nodes in one supernode), then
first-fit decreasing on the lowest-numbered node with room. One bundle per device; `STRICT_PACK` within a
node, `PACK` across nodes. A cluster whose nodes carry `pdcluster_node_<i>` resources gets each bundle
pinned to its planned node (`to_ray_placement_group_args(spec, pin_nodes=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from pdcluster.config import HardwareConfig, PoolConfig, Topology

STRICT_PACK = "STRICT_PACK"
PACK = "PACK"
NODE_RESOURCE_PREFIX = "pdcluster_node_"
NODE_RESOURCE_AMOUNT = 0.001  # a node offering 1 holds 1000 bundles


def node_resource(node_index: int) -> str:
    return f"{NODE_RESOURCE_PREFIX}{node_index}"


class PlacementError(ValueError):
    """The instances do not fit the hardware; `role` names the pool whose instance found no room."""

    def __init__(self, role: str, message: str) -> None:
        super().__init__(message)
        self.role = role


class DeviceSlot(NamedTuple):
    node_index: int
    device_id: int


@dataclass(frozen=True)
class InstanceSlots:
    """The devices of one instance; rank r runs on `devices[r]`."""

    role: str
    index: int
    devices: tuple[DeviceSlot, ...]


@dataclass(frozen=True)
class InstancePlacement:
    """One instance's placement-group spec and where the plan puts it.

    name: `{cluster}-{role}-{index}`; devices/bundles: per rank; strategy: `STRICT_PACK` or `PACK`.
    """

    role: str
    index: int
    name: str
    devices: tuple[DeviceSlot, ...]
    bundles: tuple[dict[str, float], ...]
    strategy: str

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def node_indices(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(d.node_index for d in self.devices))

    def device_ids_on(self, node_index: int) -> tuple[int, ...]:
        """Local device ids on `node_index` (what CUDA/ASCEND_RT_VISIBLE_DEVICES lists)."""
        return tuple(d.device_id for d in self.devices if d.node_index == node_index)


@dataclass(frozen=True)
class PlacementPlan:
    """Every instance of a topology, prefill first, each pool in index order.

    torch_device_type: a worker's device is `{type}:{local index}` among the devices Ray makes visible.
    """

    cluster_name: str
    accelerator: str
    ray_resource: str | None
    torch_device_type: str
    collective_backend: str
    num_nodes: int
    devices_per_node: int
    instances: tuple[InstancePlacement, ...]

    def for_role(self, role: str) -> tuple[InstancePlacement, ...]:
        return tuple(p for p in self.instances if p.role == role)

    @property
    def num_devices_used(self) -> int:
        return sum(p.num_devices for p in self.instances)


def assign_devices(hw: HardwareConfig, pools: list[tuple[str, PoolConfig]]) -> list[InstanceSlots]:
    """Pack every instance of `pools` onto the devices; PlacementError naming the pool that finds no room."""
    dpn = hw.devices_per_node
    nodes_per_group = hw.nodes_per_supernode or hw.num_nodes
    num_used = [0] * hw.num_nodes  # devices taken on each node, always a prefix 0..num_used-1
    order = [(role, i, pool) for role, pool in pools for i in range(pool.num_instances)]
    pool_rank = {role: k for k, (role, _) in enumerate(pools)}
    spanning = [x for x in order if x[2].span_nodes and x[2].devices_per_instance > dpn]
    packed = [x for x in order if not (x[2].span_nodes and x[2].devices_per_instance > dpn)]
    result: dict[tuple[str, int], tuple[DeviceSlot, ...]] = {}

    def by_size(x: tuple[str, int, PoolConfig]) -> tuple[int, int, int]:
        return (-x[2].devices_per_instance, pool_rank[x[0]], x[1])

    for role, index, pool in sorted(spanning, key=by_size):
        num_nodes_needed = pool.devices_per_instance // dpn
        start = _find_free_nodes(num_used, num_nodes_needed, nodes_per_group)
        if start is None:
            raise PlacementError(
                role,
                f"{role} instance {index} needs {num_nodes_needed} whole free nodes"
                + (f" within one supernode of {nodes_per_group}" if hw.nodes_per_supernode else "")
                + "; none are left after placing the instances before it",
            )
        nodes = range(start, start + num_nodes_needed)
        result[(role, index)] = tuple(DeviceSlot(n, d) for n in nodes for d in range(dpn))
        for n in nodes:
            num_used[n] = dpn

    for role, index, pool in sorted(packed, key=by_size):
        size = pool.devices_per_instance
        node = next((n for n in range(hw.num_nodes) if dpn - num_used[n] >= size), None)
        if node is None:
            free = sorted({dpn - u for u in num_used if u < dpn}, reverse=True)
            raise PlacementError(
                role,
                f"{role} instance {index} needs {size} devices on one node, but after placing the larger "
                f"instances no node has {size} free (free per node: {free or 'none'}); "
                "total devices suffice but they are fragmented",
            )
        first = num_used[node]
        result[(role, index)] = tuple(DeviceSlot(node, d) for d in range(first, first + size))
        num_used[node] += size

    return [InstanceSlots(role, index, result[(role, index)]) for role, index, _ in order]


def _find_free_nodes(num_used: list[int], count: int, nodes_per_group: int) -> int | None:
    for start in range(len(num_used) - count + 1):
        same_group = start // nodes_per_group == (start + count - 1) // nodes_per_group
        if same_group and not any(num_used[start : start + count]):
            return start
    return None


def plan_placement(topology: Topology) -> PlacementPlan:
    """One placement-group spec per instance of `topology`; PlacementError if they do not fit."""
    hw = topology.hardware
    spec = hw.spec
    pools = [("prefill", topology.prefill), ("decode", topology.decode)]
    bundle: dict[str, float] = {"CPU": hw.cpus_per_device}
    if spec.ray_resource is not None:
        bundle[spec.ray_resource] = 1
    instances = []
    for slots in assign_devices(hw, pools):
        pool = topology.pool(slots.role)
        spans = pool.devices_per_instance > hw.devices_per_node
        instances.append(
            InstancePlacement(
                role=slots.role,
                index=slots.index,
                name=f"{topology.name}-{slots.role}-{slots.index}",
                devices=slots.devices,
                bundles=tuple(dict(bundle) for _ in slots.devices),
                strategy=PACK if spans else STRICT_PACK,
            )
        )
    return PlacementPlan(
        cluster_name=topology.name,
        accelerator=hw.accelerator,
        ray_resource=spec.ray_resource,
        torch_device_type=spec.torch_device_type,
        collective_backend=spec.collective_backend,
        num_nodes=hw.num_nodes,
        devices_per_node=hw.devices_per_node,
        instances=tuple(instances),
    )


def nodes_to_pin(plan: PlacementPlan, cluster_resources: dict[str, float]) -> bool:
    """Whether the cluster's resources mark every planned node (pin) or none (do not).

    Raises PlacementError when only some are marked.
    """
    wanted = {node_resource(n) for spec in plan.instances for n in spec.node_indices}
    present = {name for name in wanted if cluster_resources.get(name, 0) > 0}
    if present and present != wanted:
        role = next(
            spec.role
            for spec in plan.instances
            if any(node_resource(n) not in present for n in spec.node_indices)
        )
        raise PlacementError(
            role,
            f"the Ray cluster marks nodes with {', '.join(sorted(present))} but not with "
            f"{', '.join(sorted(wanted - present))}: mark every node the plan uses, or none",
        )
    return bool(present)


def to_ray_placement_group_args(spec: InstancePlacement, pin_nodes: bool = False) -> dict[str, Any]:
    """`ray.util.placement_group` keyword arguments (fresh bundle dicts), pinned if `pin_nodes`."""
    bundles = [dict(b) for b in spec.bundles]
    if pin_nodes:
        for bundle, device in zip(bundles, spec.devices, strict=True):
            bundle[node_resource(device.node_index)] = NODE_RESOURCE_AMOUNT
    return {"bundles": bundles, "strategy": spec.strategy, "name": spec.name}
