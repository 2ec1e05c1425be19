"""Placement plans: one bundle per device, no device given twice, the packing rule, and a real placement
group on a local Ray cluster for clusters/local.yaml (created, ready, removed)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdcluster.config import (
    DEFAULT_TOPOLOGY_PATH,
    DecodePoolConfig,
    HardwareConfig,
    InterconnectConfig,
    LinkConfig,
    PrefillPoolConfig,
    Topology,
    load_topology,
)
from pdcluster.config.placement import (
    PACK,
    STRICT_PACK,
    DeviceSlot,
    PlacementError,
    PlacementPlan,
    nodes_to_pin,
    plan_placement,
    to_ray_placement_group_args,
)
from pdcluster.driver.ray_runtime import init_local_ray
from pdcluster.models import bundled_checkpoint_dir
from tests.conftest import tiny_config

CLUSTERS = Path(__file__).resolve().parents[2] / "clusters"
HAVE_BUNDLED = (bundled_checkpoint_dir() / "config.json").is_file()


def topology(hw: HardwareConfig, prefill: PrefillPoolConfig, decode: DecodePoolConfig) -> Topology:
    interconnect = InterconnectConfig(supernode=LinkConfig(1e9, 1e-6) if hw.nodes_per_supernode else None)
    return Topology(name="t", hardware=hw, interconnect=interconnect, prefill=prefill, decode=decode)


def assert_consistent(plan: PlacementPlan) -> None:
    """Every device exists and is given at most once; one bundle per device."""
    used = [d for p in plan.instances for d in p.devices]
    assert len(used) == len(set(used)) == plan.num_devices_used
    for d in used:
        assert 0 <= d.node_index < plan.num_nodes and 0 <= d.device_id < plan.devices_per_node
    for p in plan.instances:
        assert len(p.bundles) == p.num_devices
        assert p.strategy == (STRICT_PACK if len(p.node_indices) == 1 else PACK)


@pytest.mark.skipif(not HAVE_BUNDLED, reason="the bundled checkpoint is not written yet")
def test_local_plan_is_two_cpu_bundles_on_node_0():
    plan = plan_placement(load_topology(DEFAULT_TOPOLOGY_PATH))
    assert_consistent(plan)
    assert (plan.ray_resource, plan.torch_device_type, plan.collective_backend) == (None, "cpu", "gloo")
    prefill, decode = plan.instances
    assert (prefill.name, decode.name) == ("local-prefill-0", "local-decode-0")
    assert prefill.devices == (DeviceSlot(0, 0),) and decode.devices == (DeviceSlot(0, 1),)
    assert prefill.bundles == ({"CPU": 1.0},) and prefill.strategy == STRICT_PACK


def test_cm384_plan_takes_whole_nodes_for_each_instance():
    plan = plan_placement(load_topology(CLUSTERS / "cm384.yaml"))
    assert_consistent(plan)
    assert plan.num_devices_used == 14 * 32 + 288
    (decode,) = plan.for_role("decode")
    assert decode.node_indices == tuple(range(18))  # largest first
    assert decode.device_ids_on(17) == tuple(range(16))
    prefills = plan.for_role("prefill")
    assert [p.node_indices for p in prefills] == [(18 + 2 * i, 19 + 2 * i) for i in range(14)]
    assert decode.bundles[0] == {"CPU": 2.0, "NPU": 1} and decode.strategy == PACK


def test_gpu_2node_plan_puts_each_role_on_its_own_node():
    plan = plan_placement(load_topology(CLUSTERS / "gpu-2node.yaml"))
    assert_consistent(plan)
    (prefill,) = plan.for_role("prefill")
    (decode,) = plan.for_role("decode")
    assert (prefill.node_indices, decode.node_indices) == ((0,), (1,))
    assert prefill.bundles[0] == {"CPU": 8.0, "GPU": 1} and prefill.strategy == STRICT_PACK
    assert to_ray_placement_group_args(prefill) == {
        "bundles": [{"CPU": 8.0, "GPU": 1}] * 8,
        "strategy": STRICT_PACK,
        "name": "gpu-2node-prefill-0",
    }


def test_pinned_bundles_ask_for_their_planned_node_resource():
    """With `pdcluster_node_<i>` on every node the plan uses, each bundle asks for its own node's (how the
    two-node netns test puts prefill on node 0 and decode on node 1); with none of them, nothing changes;
    with some but not all, the deployment is refused rather than half pinned."""
    plan = plan_placement(
        topology(
            HardwareConfig(num_nodes=2, devices_per_node=2),
            PrefillPoolConfig(num_instances=1, devices_per_instance=2),
            DecodePoolConfig(num_instances=2, devices_per_instance=1),
        )
    )
    prefill, decode0, decode1 = plan.instances
    assert (
        to_ray_placement_group_args(prefill, pin_nodes=True)["bundles"]
        == [{"CPU": 1.0, "pdcluster_node_0": 0.001}] * 2
    )
    assert to_ray_placement_group_args(decode1, pin_nodes=True)["bundles"] == [
        {"CPU": 1.0, "pdcluster_node_1": 0.001}
    ]
    assert to_ray_placement_group_args(decode0) == to_ray_placement_group_args(decode0, pin_nodes=False)
    assert nodes_to_pin(plan, {"CPU": 4.0, "pdcluster_node_0": 1.0, "pdcluster_node_1": 1.0})
    assert not nodes_to_pin(plan, {"CPU": 4.0})
    with pytest.raises(PlacementError, match="pdcluster_node_0 but not with pdcluster_node_1"):
        nodes_to_pin(plan, {"CPU": 4.0, "pdcluster_node_0": 1.0})


def test_first_fit_decreasing_fills_nodes_before_opening_new_ones():
    hw = HardwareConfig(accelerator="h100", num_nodes=3, devices_per_node=8)
    plan = plan_placement(
        topology(
            hw,
            PrefillPoolConfig(num_instances=3, devices_per_instance=2),
            DecodePoolConfig(devices_per_instance=4),
        )
    )
    assert_consistent(plan)
    decode = plan.for_role("decode")[0]
    assert decode.devices == tuple(DeviceSlot(0, d) for d in range(4))  # the largest goes first
    assert [p.devices for p in plan.for_role("prefill")] == [
        (DeviceSlot(0, 4), DeviceSlot(0, 5)),
        (DeviceSlot(0, 6), DeviceSlot(0, 7)),
        (DeviceSlot(1, 0), DeviceSlot(1, 1)),
    ]


def test_spanning_instances_stay_inside_one_supernode():
    hw = HardwareConfig(accelerator="ascend-910c", num_nodes=6, devices_per_node=16, nodes_per_supernode=3)
    prefill = PrefillPoolConfig(num_instances=2, devices_per_instance=16)
    decode = DecodePoolConfig(num_instances=2, devices_per_instance=32, span_nodes=True)
    plan = plan_placement(topology(hw, prefill, decode))
    assert_consistent(plan)
    # decode 0 takes nodes 0-1; decode 1 cannot take 2-3 (two supernodes), so it takes 3-4.
    assert [p.node_indices for p in plan.for_role("decode")] == [(0, 1), (3, 4)]
    assert [p.node_indices for p in plan.for_role("prefill")] == [(2,), (5,)]
    with pytest.raises(PlacementError, match="2 whole free nodes within one supernode of 3") as info:
        plan_placement(topology(hw, PrefillPoolConfig(), DecodePoolConfig(3, 32, span_nodes=True)))
    assert info.value.role == "decode"


@pytest.mark.parametrize(
    ("num_nodes", "sizes"),
    [(1, (1, 1)), (2, (3, 1)), (2, (2, 2)), (4, (1, 3)), (3, (5, 2))],
)
def test_plans_never_give_a_device_twice(num_nodes, sizes):
    dpn = 8
    hw = HardwareConfig(accelerator="a100", num_nodes=num_nodes, devices_per_node=dpn)
    for p_count, d_count in itertools.product(range(1, 4), range(1, 4)):
        prefill = PrefillPoolConfig(num_instances=p_count, devices_per_instance=sizes[0])
        decode = DecodePoolConfig(num_instances=d_count, devices_per_instance=sizes[1])
        if prefill.num_devices + decode.num_devices > num_nodes * dpn:
            continue
        try:
            plan = plan_placement(topology(hw, prefill, decode))
        except PlacementError:
            continue  # fragmented: reported, never half-placed
        assert_consistent(plan)
        assert len(plan.instances) == p_count + d_count


def test_ray_args_are_fresh_copies():
    plan = plan_placement(topology(HardwareConfig(), PrefillPoolConfig(), DecodePoolConfig()))
    args = to_ray_placement_group_args(plan.instances[0])
    args["bundles"][0]["CPU"] = 99
    assert plan.instances[0].bundles[0] == {"CPU": 1.0}


def local_topology(tmp_path: Path) -> Topology:
    """clusters/local.yaml (before the bundled checkpoint exists: a copy checked against a tiny config)."""
    if HAVE_BUNDLED:
        return load_topology(DEFAULT_TOPOLOGY_PATH)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    text = DEFAULT_TOPOLOGY_PATH.read_text().replace("path: null", f"config_path: {tmp_path / 'config.json'}")
    (tmp_path / "local.yaml").write_text(text)
    return load_topology(tmp_path / "local.yaml")


@pytest.mark.slow
def test_local_plan_creates_real_placement_groups_on_a_local_ray_cluster(tmp_path):
    """Ray accepts the specs as they are: both groups of clusters/local.yaml become ready on 2 CPUs (~6 s,
    most of it starting Ray)."""
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group_table, remove_placement_group

    plan = plan_placement(local_topology(tmp_path))
    init_local_ray(num_cpus=2, configure_logging=False)
    try:
        groups = [ray.util.placement_group(**to_ray_placement_group_args(p)) for p in plan.instances]
        ray.get([g.ready() for g in groups], timeout=60)
        for spec, group in zip(plan.instances, groups, strict=True):
            table = placement_group_table(group)
            assert (table["name"], table["strategy"], table["state"]) == (spec.name, spec.strategy, "CREATED")
            assert list(table["bundles"].values()) == [dict(b) for b in spec.bundles]
        for group in groups:
            remove_placement_group(group)
        deadline = time.monotonic() + 30
        while any(placement_group_table(g)["state"] != "REMOVED" for g in groups):
            assert time.monotonic() < deadline, "placement groups not removed within 30 s"
            time.sleep(0.1)
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "timeout",
    [
        Exception("The current node timed out during startup. This could happen because ..."),
        RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y"),
    ],
    ids=["raylet-registration", "gcs-port"],
)
def test_init_local_ray_retries_rays_startup_timeout_twice(monkeypatch, timeout):
    """Ray's startup waits (the raylet's fixed 30 s to register, the driver's wait for the GCS port) can run
    out on a busy host: `init_local_ray` shuts the half-started session down and starts again, twice; any
    other failure, or a third timeout, is raised. The GCS port wait is GCS_PORT_WAIT_S during `ray.init`
    unless the user set RAY_gcs_server_port_wait_time_s, and the environment is left as it was.
    (`ray.init` and `ray.shutdown` replaced by recorders: the fault is Ray's message, injected.)"""
    import ray

    from pdcluster.driver import ray_runtime

    calls: list[str] = []
    outcomes: list[BaseException | None] = []
    waits: list[str | None] = []
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)

    started: list[subprocess.Popen] = []

    def fake_init(**options):
        calls.append("init")
        waits.append(os.environ.get("RAY_gcs_server_port_wait_time_s"))
        started.append(subprocess.Popen(["sleep", "600"]))  # what a half-started Ray leaves running
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))

    earlier = subprocess.Popen(["sleep", "600"])  # a child from before: not Ray's, left alone
    try:
        outcomes[:] = [timeout, None]
        init_local_ray(num_cpus=2)
        assert calls == ["init", "shutdown", "init"]
        assert waits == ["120", "120"] and "RAY_gcs_server_port_wait_time_s" not in os.environ
        # the failed attempt's process was killed and reaped; the started one and the earlier one run
        assert not os.path.exists(f"/proc/{started[0].pid}")  # reaped by init_local_ray itself
        assert started[1].poll() is None and earlier.poll() is None
    finally:
        for process in [earlier, *started]:
            process.kill()
            process.wait()
    started.clear()

    calls.clear()
    outcomes[:] = [timeout, timeout, timeout]
    with pytest.raises(type(timeout), match=str(timeout)[:20]):
        init_local_ray(num_cpus=2)
    # the last attempt is cleaned up too before its error is raised
    assert calls == ["init", "shutdown"] * 3 and ray_runtime.STARTUP_RETRIES == 2
    assert "RAY_gcs_server_port_wait_time_s" not in os.environ
    assert not any(os.path.exists(f"/proc/{process.pid}") for process in started)

    waits.clear()
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "7")
    outcomes[:] = [None]
    init_local_ray(num_cpus=2)
    assert waits == ["7"] and os.environ["RAY_gcs_server_port_wait_time_s"] == "7"

    calls.clear()
    outcomes[:] = [RuntimeError("port in use")]
    with pytest.raises(RuntimeError, match="port in use"):
        init_local_ray(num_cpus=2)
    assert calls == ["init"]
    assert os.path.exists(f"/proc/{started[-1].pid}")  # not a startup timeout: nothing of it killed
    for process in started:
        process.kill()
        process.wait()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), SystemExit(15)], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_while_ray_starts_stops_every_process_it_started(monkeypatch, interrupt):
    """A Ctrl-C, or a SIGTERM meeting Ray's `sys.exit(15)`, during `ray.init`: the processes the attempt
    started are killed, their own children too (the raylet's agents outlived a raylet killed alone by a
    minute or more), and the interrupt goes on up; a child from before is left alone. (`ray.init` replaced
    by one that starts a process with a child of its own, then is interrupted: the fault, injected.)"""
    import ray

    started: list[subprocess.Popen] = []
    agents: list[int] = []

    def fake_init(**options):
        # a "raylet" with an "agent" below it, which prints its pid
        raylet = subprocess.Popen(
            ["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True
        )
        started.append(raylet)
        agents.append(int(raylet.stdout.readline()))  # the agent runs from here on
        raise interrupt

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    earlier = subprocess.Popen(["sleep", "600"])
    try:
        with pytest.raises(type(interrupt)):
            init_local_ray(num_cpus=2)
        (raylet,), (agent_pid,) = started, agents
        assert raylet.poll() is not None  # killed and reaped by init_local_ray
        deadline = time.monotonic() + 10.0  # the agent, reparented, is reaped by init (pid 1) once killed
        while (
            os.path.exists(f"/proc/{agent_pid}") and _state(agent_pid) != "Z" and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{agent_pid}") or _state(agent_pid) == "Z"
        assert earlier.poll() is None
    finally:
        earlier.kill()
        earlier.wait()
        for process in started:
            process.kill()
            process.wait()


def _state(pid: int) -> str:
    """A process's state letter from /proc (R, S, Z, ...); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_a_sigterm_meeting_rays_handler_inside_the_block_goes_to_the_callers():
    """`keeping_sigterm_handler`: Ray's `ray.init` sets SIGTERM to `sys.exit(15)` at once; a SIGTERM then
    is a SystemExit, which the block hands to the caller's handler (deploy's raises KeyboardInterrupt and
    shuts down) and whose handler it puts back. Other exits pass unchanged."""
    from pdcluster.driver.ray_runtime import keeping_sigterm_handler

    def callers(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, callers)
    try:
        with pytest.raises(KeyboardInterrupt):
            with keeping_sigterm_handler():
                signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init does
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) is callers
        with pytest.raises(SystemExit):
            with keeping_sigterm_handler():
                sys.exit(3)
    finally:
        signal.signal(signal.SIGTERM, previous)
