"""Placement: which node and devices each prefill/decode instance gets, as plain data for Ray.

`plan_placement(topology)` is a pure function. It returns one `InstancePlacement` per instance: the
node(s) and local device ids the instance is meant to occupy, and the placement-group spec that reserves
them (`bundles`, `strategy`, `name`). The actor layer turns each spec into
`ray.util.placement_group(**to_ray_placement_group_args(spec))` and starts one worker per device,
rank r in bundle r.

Packing rule (deterministic, no Ray calls):
  1. Instances that span nodes (`span_nodes: true`) are placed first, largest first; each takes
     `devices_per_instance / devices_per_node` whole free nodes, consecutive and inside one supernode.
  2. The other instances go first-fit decreasing: largest first (prefill before decode on ties), each on
     the lowest-numbered node with enough free devices, taking the lowest free device ids there.
This fills nodes before opening new ones, leaving whole nodes free for later instances.

Bundles: one per device, `{"CPU": cpus_per_device, "GPU" | "NPU": 1}` (CPU-only on `cpu`).
Strategy: `STRICT_PACK` for an instance within one node (all its bundles on one node or none);
`PACK` for an instance spanning nodes (Ray fills as few nodes as it can; with whole nodes free that is
exactly the planned nodes). Instances are separate placement groups, so Ray does not coordinate them;
the plan's node indices say where this packing expects each instance.

Pinning to nodes: a Ray cluster whose node i carries the custom resource `pdcluster_node_<i>` (e.g.
`ray start ... --resources '{"pdcluster_node_0": 1}'`) gets each bundle pinned to its planned node:
`to_ray_placement_group_args(spec, pin_nodes=True)` adds `{"pdcluster_node_<i>": 0.001}` to the bundle
of a device planned on node i (`node_resource`, `NODE_RESOURCE_AMOUNT`), so prefill lands where the plan
puts prefill and decode where it puts decode. `nodes_to_pin` tells from the cluster's resources whether
to; without those resources, Ray chooses the nodes (any node with room).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdcluster.orchestrator.topology import HardwareConfig, PoolConfig, Topology

STRICT_PACK = "STRICT_PACK"
PACK = "PACK"
NODE_RESOURCE_PREFIX = "pdcluster_node_"  # custom Ray resource naming a node by its plan index
NODE_RESOURCE_AMOUNT = 0.001  # what one pinned bundle takes of it (a node offering 1 holds 1000 bundles)


def node_resource(node_index: int) -> str:
    """The custom Ray resource that marks node `node_index` of the plan: `pdcluster_node_<index>`."""
    return f"{NODE_RESOURCE_PREFIX}{node_index}"


class PlacementError(ValueError):
    """The instances do not fit the hardware; `role` names the pool whose instance found no room."""

    def __init__(self, role: str, message: str) -> None:
        super().__init__(message)
        self.role = role


@dataclass(frozen=True)
class DeviceSlot:
    """One device: `node_index` in [0, num_nodes), `device_id` in [0, devices_per_node) on that node."""

    node_index: int
    device_id: int


@dataclass(frozen=True)
class InstanceSlots:
    """The devices of one instance, in rank order (rank r runs on `devices[r]`)."""

    role: str
    index: int
    devices: tuple[DeviceSlot, ...]


@dataclass(frozen=True)
class InstancePlacement:
    """One instance's placement-group spec and where the plan puts it.

    Attributes:
        role: `prefill` or `decode`.
        index: instance index within its pool.
        name: placement-group name, `{cluster}-{role}-{index}`; unique within the cluster.
        devices: rank r's node and local device id (`DeviceSlot`); `len(devices) == len(bundles)`.
        bundles: rank r's Ray resources, `{"CPU": n}` plus `{"GPU": 1}` / `{"NPU": 1}` on accelerators.
            Read-only: `to_ray_placement_group_args` hands Ray copies.
        strategy: `STRICT_PACK` (within one node) or `PACK` (spanning whole nodes).
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
        """Nodes the instance occupies, in rank order, without repeats."""
        return tuple(dict.fromkeys(d.node_index for d in self.devices))

    def device_ids_on(self, node_index: int) -> tuple[int, ...]:
        """Local device ids of this instance on `node_index` (what CUDA/ASCEND_RT_VISIBLE_DEVICES lists)."""
        return tuple(d.device_id for d in self.devices if d.node_index == node_index)


@dataclass(frozen=True)
class PlacementPlan:
    """Every instance of a topology, prefill instances first, each pool in index order.

    Attributes:
        cluster_name: the topology's `name`.
        accelerator: catalog name (`hardware.accelerator`).
        ray_resource: `GPU`, `NPU`, or None on `cpu`.
        torch_device_type: `cpu`, `cuda` or `npu`; a worker's device is `{type}:{local index}`, where the
            local index is its position among the devices Ray makes visible to it.
        collective_backend: torch.distributed backend inside an instance (`gloo`, `nccl`, `hccl`).
        num_nodes: nodes in the cluster.
        devices_per_node: devices per node.
        instances: one spec per instance.
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
    """Pack every instance of `pools` onto the hardware's devices (rule in the module docstring).

    Returns one `InstanceSlots` per instance, in pool order and index order within a pool.
    Raises:
        PlacementError: an instance finds no room; `role` is its pool.
    """
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
    """First index of `count` consecutive untouched nodes that lie in one group of `nodes_per_group`."""
    for start in range(len(num_used) - count + 1):
        same_group = start // nodes_per_group == (start + count - 1) // nodes_per_group
        if same_group and not any(num_used[start : start + count]):
            return start
    return None


def plan_placement(topology: Topology) -> PlacementPlan:
    """One placement-group spec per instance of `topology` (see the module docstring).

    Raises:
        PlacementError: the instances do not fit (`load_topology` reports this as a validation error).
    """
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
    """Whether to pin bundles to their planned nodes, from a Ray cluster's resources
    (`ray.cluster_resources()`): True when the cluster has `pdcluster_node_<i>` for every node the plan
    uses, False when it has none of them.

    Raises:
        PlacementError: it has some of them but not all (a node left unmarked: pinning would leave its
            instances unplaceable, not pinning would ignore the marks).
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
    """Keyword arguments for `ray.util.placement_group`: `bundles` (fresh dicts), `strategy`, `name`.
    `pin_nodes`: each bundle also asks for `NODE_RESOURCE_AMOUNT` of its planned node's `node_resource`."""
    bundles = [dict(b) for b in spec.bundles]
    if pin_nodes:
        for bundle, device in zip(bundles, spec.devices, strict=True):
            bundle[node_resource(device.node_index)] = NODE_RESOURCE_AMOUNT
    return {"bundles": bundles, "strategy": spec.strategy, "name": spec.name}
