"""What a simulation runs with besides the topology and the trace (`simulator.simulate`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdcluster.planner.control_plane import ControlPlane
from pdcluster.planner.step_model import StepTimeModel


@dataclass(frozen=True)
class SimOptions:
    """Step models, MTP acceptance per position, seed, live path (None: 0 s), node cores (None: unshared)."""

    prefill_model: StepTimeModel
    decode_model: StepTimeModel
    acceptance_per_position: Sequence[float] = ()
    seed: int = 0
    control_plane: ControlPlane | None = None
    cores_per_node: float | None = None
