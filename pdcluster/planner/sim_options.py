"""What a simulation runs with besides the topology and the trace (`simulator.simulate`, `ClusterSimulator`,
`autoscale_sim.simulate_autoscale`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdcluster.planner.control_plane import ControlPlane
from pdcluster.planner.step_model import StepTimeModel


@dataclass(frozen=True)
class SimOptions:
    """Step-time models per pool, MTP acceptance per draft position, the seed of the acceptance draws,
    the live path's seconds (`control_plane`, None: zero) and the cores a `cpu` node's ranks share
    (`cores_per_node`, None: unshared)."""

    prefill_model: StepTimeModel
    decode_model: StepTimeModel
    acceptance_per_position: Sequence[float] = ()
    seed: int = 0
    control_plane: ControlPlane | None = None
    cores_per_node: float | None = None
