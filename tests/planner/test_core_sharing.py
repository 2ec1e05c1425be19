"""Instances sharing a node's cores slow each other (`planner.core_sharing`), in the simulator too."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.config import load_topology
from pdcluster.planner.core_sharing import NodeCores
from pdcluster.planner.simulator import SimOptions, simulate
from pdcluster.planner.step_model import StepShape
from pdcluster.planner.trace import TraceRequest

ROOT = Path(__file__).resolve().parents[2]


def test_processor_sharing_moves_the_ends():
    node = NodeCores(2.0)
    assert node.start("a", 1.0, 1.0, 0.0) == [("a", 1.0)]
    assert dict(node.start("b", 1.0, 1.0, 0.5)) == {"a": 1.0, "b": 1.5}  # 2 demanded of 2: full speed
    ends = dict(node.start("c", 3.0, 1.0, 0.5))  # 3 demanded of 2: each at 2/3 speed from 0.5 on
    assert ends["a"] == pytest.approx(0.5 + 0.5 * 3 / 2) and ends["c"] == pytest.approx(0.5 + 3 * 3 / 2)
    ends = dict(node.finish("a", 1.25))  # back to full speed: b had 1 - 0.75 * 2/3 = 0.5 left
    assert ends["b"] == pytest.approx(1.75) and set(ends) == {"b", "c"}
    with pytest.raises(ValueError, match="already busy"):
        node.start("b", 1.0, 1.0, 1.3)
    with pytest.raises(ValueError, match="cores"):
        NodeCores(0.0)


def test_background_demand_slows_a_lone_engine():
    node = NodeCores(2.0, background=1.5)  # one busy engine + 1.5 cores of other processes on 2 cores
    assert node.start("a", 1.0, 1.0, 0.0) == [("a", pytest.approx(2.5 / 2))]
    assert dict(node.finish("a", 1.25)) == {}
    assert NodeCores(2.0, background=0.5).start("a", 1.0, 1.0, 0.0) == [("a", 1.0)]  # 1.5 of 2: no wait
    with pytest.raises(ValueError, match="background"):
        NodeCores(2.0, background=-1.0)


class FixedStep:
    """Every non-empty step takes `seconds` of full-speed work; handoffs are instant."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step_time_s(self, step: StepShape) -> float:
        return self.seconds if step.prefill or step.decode else 0.0

    def kv_handoff_s(self, num_prompt_tokens: int, prefill_compute_s: float) -> float:
        return 0.0


def test_three_instances_on_two_cores_are_slower_than_on_three():
    topology = load_topology(ROOT / "clusters" / "local-1p2d.yaml")  # 1 prefill + 2 decode on one node
    requests = [TraceRequest(0.01 * i, 64, 16) for i in range(40)]
    model = FixedStep(0.01)

    def run(cores):
        result = simulate(topology, requests, SimOptions(model, model, (0.5,), cores_per_node=cores))
        return result.summary["ttft_ms"]["p50"], result.summary["tpot_ms"]["p50"]

    alone = run(None)
    assert run(3.0) == alone  # as many cores as busy instances: nobody waits
    ttft, tpot = run(2.0)
    assert ttft > alone[0] and tpot > alone[1]
    # with every instance busy the most a step can stretch is 3/2
    assert tpot <= alone[1] * 1.5 + 1e-9


def test_the_driver_and_background_load_slow_the_engines_on_the_driver_node():
    from pdcluster.planner.control_plane import ControlPlane

    topology = load_topology(ROOT / "clusters" / "local.yaml")  # 1 prefill + 1 decode on one node
    requests = [TraceRequest(0.5 * i, 64, 16) for i in range(10)]  # one at a time: no queueing
    model = FixedStep(0.01)

    def tpot_ms(control_plane):
        options = SimOptions(model, model, (0.0,), cores_per_node=2.0, control_plane=control_plane)
        result = simulate(topology, requests, options)
        return result.summary["tpot_ms"]["p50"]

    alone = tpot_ms(None)
    assert alone == pytest.approx(10.0, abs=1e-6)  # one 10 ms decode step per token, 1 of 2 cores busy
    # 1.5 cores of other load: a lone decode step runs at 2 / 2.5 of full speed
    assert tpot_ms(ControlPlane(background_cores=1.5)) == pytest.approx(10.0 * 2.5 / 2, abs=1e-6)
    # the driver's 5 ms of CPU per 10 ms decode step adds half a core: 2 / (1 + 0.5 + 1.5) of full speed
    both = ControlPlane(background_cores=1.5, host_cpu_per_decode_step_s=0.005)
    assert tpot_ms(both) == pytest.approx(10.0 * 3.0 / 2, abs=1e-6)


def test_the_driver_streams_each_decoded_request_so_its_demand_grows_with_the_batch():
    from pdcluster.planner.control_plane import ControlPlane

    topology = load_topology(ROOT / "clusters" / "local.yaml")
    model = FixedStep(0.01)
    cp = ControlPlane(background_cores=1.0, host_cpu_per_decode_step_s=0.005)

    def tpot_ms(num_requests):
        requests = [TraceRequest(0.0, 64, 16)] * num_requests
        result = simulate(
            topology, requests, SimOptions(model, model, (0.0,), cores_per_node=2.0, control_plane=cp)
        )
        return [r.tpot_s * 1e3 for r in result.results]

    # 5 ms of driver CPU per decoded request per 10 ms step: alone 2 / (1 + 0.5 + 1) of full speed; two
    # decoded together 2 / (1 + 1 + 1), and the second one's prefill overlapping the first's decode only
    # slows them more (charged per step instead of per request, the pair would stay near 12.5 ms)
    assert tpot_ms(1) == pytest.approx([12.5], abs=1e-6)
    assert min(tpot_ms(2)) >= 15.0 - 1e-6


def test_a_prefills_corunners_slow_decode_steps_only_while_the_prefill_runs():
    """`prefill_corunner_cores` joins a prefill step's demand; a decode step alone does not see it, as it
    sees `background_cores`."""
    from pdcluster.planner.control_plane import ControlPlane

    topology = load_topology(ROOT / "clusters" / "local.yaml")
    requests = [TraceRequest(0.5 * i, 64, 16) for i in range(10)]  # one at a time: no overlap
    model = FixedStep(0.01)

    def ttft_tpot_ms(control_plane):
        options = SimOptions(model, model, (0.0,), cores_per_node=2.0, control_plane=control_plane)
        summary = simulate(topology, requests, options).summary
        return summary["ttft_ms"]["p50"], summary["tpot_ms"]["p50"]

    # a lone prefill step demands 1 + 1.5 cores of 2: it runs at 2 / 2.5 of full speed; decode at full
    ttft, tpot = ttft_tpot_ms(ControlPlane(prefill_corunner_cores=1.5))
    assert ttft == pytest.approx(10.0 * 2.5 / 2, abs=1e-6) and tpot == pytest.approx(10.0, abs=1e-6)
    # the same 1.5 cores as steady background slow both
    ttft, tpot = ttft_tpot_ms(ControlPlane(background_cores=1.5))
    assert ttft == pytest.approx(10.0 * 2.5 / 2, abs=1e-6) and tpot == pytest.approx(10.0 * 2.5 / 2, abs=1e-6)
