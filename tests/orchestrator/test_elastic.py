"""Elastic EP's parts without Ray: telling a lost rank from one probe round
(`driver.elastic_loss.find_rank_loss`), an abandoned collective (`models.ep_dispatch.WAITS`), an aborted
join (`driver.instance_group.meet`), a survivor's shrink and grow of its experts over real gloo groups
in-process (`engine.elastic_ep`: every slot holds its logical expert's checkpoint weights), and the
per-instance figures /metrics shows."""

from __future__ import annotations

import inspect
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest

from pdcluster.driver.deployment import free_ports
from pdcluster.driver.elastic_loss import find_rank_loss
from pdcluster.driver.instance import Instance
from pdcluster.driver.instance_group import meet
from pdcluster.driver.messages import InstanceGroupSpec
from pdcluster.engine.elastic_ep import grow_runtime, plan_shrink, shrink_runtime
from pdcluster.engine.expert_parallel import ExpertParallelRuntime, load_rank_shard
from pdcluster.engine.parallel import ParallelConfig, make_instance_group
from pdcluster.entrypoints.openai.metrics import ApiMetrics
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.elastic_placement import PlacementRefused
from pdcluster.models.ep_dispatch import WAITS, EPCollectiveError, wait
from pdcluster.models.expert_placement import ExpertPlacement
from pdcluster.models.loader import load_checkpoint


def _load(group_error: str | None, blocked_s: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(instance_group_error=group_error, pid=1, collective_wait_s=blocked_s)


def test_a_rank_is_lost_once_every_answering_rank_saw_its_group_fail() -> None:
    ray = pytest.importorskip("ray")
    instance = Instance("decode", 0, [object(), object(), object()])
    timeout = ray.exceptions.GetTimeoutError("no answer")
    assert find_rank_loss(instance, [_load(None)] * 3, 5.0) is None  # every rank answered
    assert find_rank_loss(instance, [timeout] * 3, 5.0) is None  # none did: nothing to shrink onto
    assert find_rank_loss(instance, [_load(None), timeout, _load("x")], 5.0) is None  # rank 0 has not noticed
    loss = find_rank_loss(instance, [_load("gloo: connection closed"), timeout, _load("timed out")], 5.0)
    assert (loss.role, loss.index, loss.lost, loss.survivors) == ("decode", 0, (1,), (0, 2))
    assert "rank 1 stopped answering" in loss.why


def test_a_silent_rank_is_stalled_once_its_peers_waited_the_stall_time_in_one_collective() -> None:
    ray = pytest.importorskip("ray")
    instance = Instance("decode", 0, [object(), object(), object()])
    timeout = ray.exceptions.GetTimeoutError("no answer")
    assert find_rank_loss(instance, [_load(None, 4.9), timeout, _load(None, 6.0)], 5.0) is None  # not yet
    assert find_rank_loss(instance, [_load(None, 0.0), timeout, _load("x")], 5.0) is None  # rank 0 steps on
    loss = find_rank_loss(instance, [_load(None, 5.0), timeout, _load("timed out")], 5.0)
    assert (loss.lost, loss.survivors) == ((1,), (0, 2))


def test_a_dead_rank_is_lost_at_once_whatever_its_peers_report() -> None:
    ray = pytest.importorskip("ray")
    instance = Instance("decode", 0, [object(), object(), object()])
    died = ray.exceptions.ActorDiedError()
    loss = find_rank_loss(instance, [_load(None), died, _load(None, 0.2)], 5.0)
    assert (loss.lost, loss.survivors) == ((1,), (0, 2)) and "rank 1 died" in loss.why
    timeout = ray.exceptions.GetTimeoutError("no answer")  # and a silent one: its peers decide
    assert find_rank_loss(instance, [died, timeout, _load(None, 1.0)], 5.0) is None


def test_an_abandoned_group_ends_its_blocked_collectives_at_once() -> None:
    """Two ranks of a gloo group of 3 block in an allreduce the third never joins; `WAITS.abandon()`
    ends both waits long before the group's collective timeout."""
    groups = _groups(3)
    WAITS.watch(groups[0])
    errors: list[BaseException] = []

    def blocked(group) -> None:
        try:
            wait(group.allreduce([torch.ones(4)]), "test allreduce", group.rank())
        except EPCollectiveError as e:
            errors.append(e)

    threads = [threading.Thread(target=blocked, args=(g,)) for g in groups[:2]]
    for t in threads:
        t.start()
    deadline_s = time.monotonic() + 30.0
    while WAITS.blocked_s() < 0.2 and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert WAITS.blocked_s() >= 0.2
    started_s = time.monotonic()
    WAITS.abandon()
    for t in threads:
        t.join(30.0)
    try:
        assert len(errors) == 2 and all("abandoned" in str(e) for e in errors)
        assert time.monotonic() - started_s < GROUP_TIMEOUT_S / 2  # not the collective's timeout
        assert WAITS.blocked_s() == 0.0
    finally:
        WAITS.watch(groups[0])  # (this process's waits are not abandoned for the next tests)


def test_an_aborted_meet_raises_at_once_instead_of_waiting_its_timeout() -> None:
    ports = free_ports("127.0.0.1", 2)
    spec = InstanceGroupSpec(0, 2, f"tcp://127.0.0.1:{ports[0]}", ports[1], "gloo", 10.0, 60.0, "s")
    started_s = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted"):
        meet(spec, aborted=lambda: time.monotonic() - started_s > 0.2)
    assert time.monotonic() - started_s < spec.rendezvous_timeout_s / 2


GROUP_TIMEOUT_S = inspect.signature(make_instance_group).parameters["timeout_s"].default


def _groups(world: int) -> list:
    host, ports = "127.0.0.1", free_ports("127.0.0.1", 1)
    groups: dict[int, object] = {}
    threads = [
        threading.Thread(
            target=lambda r=r: groups.__setitem__(r, make_instance_group(host, ports[0], r, world))
        )
        for r in range(world)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [groups[r] for r in range(world)]


def _assert_slots_hold_checkpoint_experts(runtime: ExpertParallelRuntime, full) -> None:
    for row, moe in enumerate(runtime.moe):
        layer = runtime.layer_indices[row]
        logical = runtime.placement.local_logical_experts(row, runtime.rank)
        assert len(moe.experts) == len(logical)
        for slot, expert in enumerate(logical):
            want = full.model.layers[layer].mlp.experts[expert].state_dict()
            for name, tensor in moe.experts[slot].state_dict().items():
                assert torch.equal(tensor, want[name]), (row, slot, expert, name)  # the same stored values


def test_a_survivor_takes_every_expert_then_gives_back_its_peers_share() -> None:
    path = str(bundled_checkpoint_dir())
    full = load_checkpoint(path)
    parallel = ParallelConfig(expert_parallel_size=2, rank=0, num_redundant_experts=2)
    model, placement = load_rank_shard(path, parallel, "cpu", torch.float32)
    old_group, _ = _groups(2)
    runtime = ExpertParallelRuntime(model, parallel, old_group, placement)
    with pytest.raises(PlacementRefused):  # 5 slots cannot hold 8 experts
        plan_shrink(runtime, frozenset({1}), max_local_experts=5)
    (alone,) = _groups(1)
    shrunk_runtime, shrunk = shrink_runtime(runtime, alone, frozenset({1}), None, path)
    assert (shrunk_runtime.num_ranks, shrunk_runtime.placement.num_local_experts) == (1, 8)
    assert sorted(shrunk_runtime.placement.local_logical_experts(0, 0)) == list(range(8))
    assert {e for _, _, _, e in shrunk.loads} == {5, 6, 7}  # rank 0 held 0..4: only the rest is read
    _assert_slots_hold_checkpoint_experts(shrunk_runtime, full)
    grown_group, _ = _groups(2)
    observed = torch.arange(shrunk_runtime._logical_zero.numel()).view_as(shrunk_runtime._logical_zero)
    shrunk_runtime._load_window.append(observed)
    grown, num_read = grow_runtime(shrunk_runtime, grown_group, 2, path)
    assert (grown.num_ranks, grown.rank, grown.placement.num_local_experts, num_read) == (2, 0, 5, 0)
    assert grown.rebalance_requested and [torch.equal(w, observed) for w in grown._load_window] == [True]
    _assert_slots_hold_checkpoint_experts(grown, full)


def test_metrics_show_each_instances_live_ranks_and_recoveries() -> None:
    instances = {
        "decode-0": {"ranks": 1, "deployed_ranks": 2, "degraded": True, "recoveries": 1, "rejoins": 0},
        "prefill-0": {"ranks": 2, "deployed_ranks": 2, "degraded": False, "recoveries": 0, "rejoins": 0},
    }
    metrics = ApiMetrics(stats=lambda: {"instances": instances})
    text = generate_latest(metrics.registry).decode()
    assert 'pdcluster_instance_live_ranks{instance="decode-0"} 1.0' in text
    assert 'pdcluster_instance_degraded{instance="decode-0"} 1.0' in text
    assert 'pdcluster_instance_degraded{instance="prefill-0"} 0.0' in text
    assert 'pdcluster_instance_recoveries_total{instance="decode-0"} 1.0' in text


@pytest.mark.parametrize("where", ["forward", "mtp_forward"])
def test_a_step_rolled_back_after_a_lost_peer_runs_again_with_the_same_tokens(where: str) -> None:
    """A collective failing inside the main forward (nothing sampled) or inside the MTP forward (main KV
    written, tokens sampled, drafts half proposed): `roll_back_step` puts every request back at its step's
    start, and stepping on gives one engine's greedy tokens (the failed step's KV writes are rewritten)."""
    from pdcluster.engine.elastic_ep import roll_back_step
    from pdcluster.engine.llm import LLM
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.models.ep_dispatch import EPCollectiveError
    from pdcluster.models.prompts import heldout_def_prompts

    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [llm.tokenizer.encode(p) for p in heldout_def_prompts(2, min_chars=40, max_chars=200)]
    expected = [out.token_ids for out in llm.generate(prompts, params)]
    engine = llm.engine
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    for _ in range(6):
        engine.step()
    output = engine.scheduler.schedule()
    before = {item.request_id: item.start_position for item in output.scheduled}
    assert sorted(before) == sorted(ids)
    original = getattr(engine.runner, where)

    def lost(*args, **kwargs):
        raise EPCollectiveError("EP rank 0: the peer is gone")

    setattr(engine.runner, where, lost)
    with pytest.raises(EPCollectiveError) as raised:
        engine.executor.execute(output)
    setattr(engine.runner, where, original)
    assert not roll_back_step(engine.scheduler, output, RuntimeError("not a collective"))  # nothing done
    assert roll_back_step(engine.scheduler, output, raised.value)
    for rid in ids:
        request = engine.scheduler.requests[rid]
        assert (request.num_computed_tokens, request.num_output_placeholders) == (before[rid], 0)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [got[rid] for rid in ids] == expected


def test_one_rank_asking_for_a_rebalance_makes_every_rank_rebalance_at_the_next_step_with_work() -> None:
    """As a grown survivor asks (`grow_runtime`) while the newcomer does not: both rebalance at once (the
    step agreement carries the request), the placement versions stay equal, and an idle step waits."""
    path = str(bundled_checkpoint_dir())
    groups = _groups(2)
    runtimes = []
    for rank in range(2):
        parallel = ParallelConfig(expert_parallel_size=2, rank=rank, num_redundant_experts=2)
        model, placement = load_rank_shard(path, parallel, "cpu", torch.float32)
        runtimes.append(ExpertParallelRuntime(model, parallel, groups[rank], placement))
    runtimes[0].rebalance_requested = True

    def steps(has_work: bool) -> list[bool]:
        out: dict[int, bool] = {}
        threads = [
            threading.Thread(target=lambda r=r: out.__setitem__(r, runtimes[r].begin_step(has_work, 0)))
            for r in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return [out[r] for r in range(2)]

    assert steps(False) == [False, False] and [r.num_rebalances for r in runtimes] == [0, 0]
    assert steps(True) == [True, True] and [r.num_rebalances for r in runtimes] == [1, 1]
    assert not runtimes[0].rebalance_requested
    assert steps(True) == [True, True] and [r.num_rebalances for r in runtimes] == [1, 1]


@pytest.mark.parametrize(
    "message",
    [
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=668, OpType=ALLREDUCE, "
        "NumelIn=6, NumelOut=6, Timeout(ms)=10000) ran for 10097 milliseconds before timing out.",
        "NCCL communicator was aborted on rank 0.",
        "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, "
        "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error",
        "[Rank 0] Watchdog caught collective operation timeout: WorkHCCL(SeqNum=12, OpType=ALLTOALL_BASE, "
        "Timeout(ms)=10000) ran for 10010 milliseconds before timing out.",
        "HCCL function error: hcclAllReduce(...), error code is 7",
    ],
)
def test_nccl_and_hccl_watchdog_aborts_are_the_lost_peer_event(message: str) -> None:
    """(NCCL / HCCL cannot run here: the mapping alone.) A watchdog abort raised as it is, or as the cause
    of the engine's step error, is the same event as gloo's failed collective: the step is rolled back and
    the rank reports its group failed."""
    from pdcluster.engine.elastic_ep import lost_peer
    from pdcluster.models.ep_dispatch import EPCollectiveError

    step_error = RuntimeError("engine step failed")
    step_error.__cause__ = RuntimeError(message)
    assert lost_peer(RuntimeError(message)) and lost_peer(step_error)
    assert lost_peer(EPCollectiveError("EP rank 0: step agreement failed: Connection closed by peer"))
    assert not lost_peer(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not lost_peer(ValueError("request r0: sampled [1, 2] does not fit drafts [3]"))


def test_survivors_at_different_placements_after_a_rank_lost_mid_rebalance_agree_on_one() -> None:
    """EP3 (9 slots: 8 experts + 1 redundant) loses rank 2 while an EPLB rebalance moved weights: survivor 0
    switched to the new placement (its transfers were done), survivor 1 did not. Both shrink onto the same
    placement (the newest, rank 0's) and every slot of each holds its expert's checkpoint weights."""
    from pdcluster.engine.elastic_ep import _load_experts

    path = str(bundled_checkpoint_dir())
    full = load_checkpoint(path)
    old_groups = _groups(3)
    runtimes = []
    for rank in range(2):
        parallel = ParallelConfig(expert_parallel_size=3, rank=rank, num_redundant_experts=1)
        model, placement = load_rank_shard(path, parallel, "cpu", torch.float32)
        runtimes.append(ExpertParallelRuntime(model, parallel, old_groups[rank], placement))
    switched = runtimes[0]
    phy2log = switched.placement.phy2log.clone()
    phy2log[:, [0, 3]] = phy2log[:, [3, 0]]  # rank 0's slot 0 and rank 1's slot 0 trade experts
    switched.placement = ExpertPlacement.from_phy2log(phy2log, 8, 3)
    _load_experts(switched, path, [(row, 0, int(phy2log[row, 0])) for row in range(phy2log.shape[0])])
    switched.num_rebalances = 1
    _assert_slots_hold_checkpoint_experts(switched, full)
    new_groups = _groups(2)
    shrunk: dict[int, object] = {}

    def shrink(rank: int) -> None:
        shrunk[rank] = shrink_runtime(runtimes[rank], new_groups[rank], frozenset({2}), None, path)[0]

    threads = [threading.Thread(target=shrink, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert torch.equal(shrunk[0].placement.phy2log, shrunk[1].placement.phy2log)
    for rank in range(2):
        _assert_slots_hold_checkpoint_experts(shrunk[rank], full)


@pytest.mark.parametrize(
    ("path", "role"),
    [
        ("clusters/local-ep.yaml", "decode"),
        ("clusters/cm384.yaml", "decode"),
        ("clusters/gpu-2node.yaml", "decode"),
    ],
)
def test_survivor_expert_slots_are_the_most_the_devices_memory_holds(path: str, role: str) -> None:
    """`survivor_expert_slots` against the preflight memory rule (`planner.memory.pool_memory_overflow`): a
    pool of that many slots per rank fits one device, one slot more does not (unless it is every expert)."""
    import dataclasses

    from pdcluster.config import load_topology
    from pdcluster.config.rules import read_model_architecture
    from pdcluster.driver.elastic_budget import survivor_expert_slots
    from pdcluster.planner.memory import pool_memory_overflow, pool_resident_params

    topology = load_topology(path)
    pool, spec = topology.pool(role), topology.hardware.spec
    arch, dtype = read_model_architecture(topology.model), topology.model.resolved_weight_dtype(spec)
    slots, ep = survivor_expert_slots(topology, role), pool.expert_parallel_size

    def fits(n: int) -> bool:
        grown = dataclasses.replace(pool, num_redundant_experts=n * ep - arch.n_routed_experts)
        return pool_memory_overflow(arch, grown, spec, dtype) is None

    assert slots >= pool_resident_params(arch, pool).experts_per_layer and fits(slots)
    assert slots == arch.n_routed_experts or not fits(slots + 1)


def test_elastic_stall_s_must_be_positive(tmp_path) -> None:
    from pdcluster.config import TopologyError, load_topology

    path = tmp_path / "t.yaml"
    path.write_text(
        "name: t\nhardware: {accelerator: cpu, num_nodes: 1, devices_per_node: 4}\n"
        "decode: {devices_per_instance: 2, expert_parallel_size: 2, elastic_stall_s: 0}\n"
    )
    with pytest.raises(TopologyError, match=r"t.yaml:3: decode.elastic_stall_s: must be > 0, got 0.0"):
        load_topology(path)


def test_the_recovery_bench_keeps_the_topologys_timeouts_by_default() -> None:
    from bench.elastic_recovery import _topology

    args = SimpleNamespace(topology="clusters/local-ep.yaml", kv_timeout_s=None, scenario="stall")
    topology = _topology(args)
    assert (topology.kv_transfer.timeout_s, topology.decode.elastic_stall_s) == (30.0, 5.0)
