"""Stalls and crashes on a real local Ray (one deployment for the module; each test says what it proves).

A stall is SIGSTOP of the actor's process (as a long GC pause, swapping or a debugger would), a crash is
SIGKILL (as the OOM killer would). Nothing else is faked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

import pytest

from pdcluster.config import load_topology
from pdcluster.driver.backend import BackendUnavailable
from pdcluster.driver.cluster import PROBE_INTERVAL_S, Cluster
from pdcluster.driver.rank_actors import ready_timeout_s
from pdcluster.engine.sampling_params import SamplingParams
from tests.cluster.conftest import assert_nothing_held, call_bound_s, deployed_with_loop, request_bound_s
from tests.faults import FAULT_WORKERS

pytestmark = pytest.mark.slow

PROMPT = "def add(a, b):\n    return"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE_WATCHDOG_S = 2.0


@pytest.fixture(scope="module")
def cluster(ray_session):
    topo = load_topology("clusters/local.yaml")
    topo = dataclasses.replace(
        topo,
        # timeout_s 6: call_timeout_s 3 s, so a stall is noticed within seconds.
        kv_transfer=dataclasses.replace(topo.kv_transfer, transport="grpc", timeout_s=6),
        # eager; the engine watchdog at 2 s (its minimum is 1; this model's passes take milliseconds)
        decode=dataclasses.replace(
            topo.decode, kv_cache_memory_bytes=16 << 20, compile=False, engine_watchdog_s=ENGINE_WATCHDOG_S
        ),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
    )
    with deployed_with_loop(topo, worker_classes=FAULT_WORKERS) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def expected_tokens(cluster) -> list[int]:
    return _generate(cluster, "baseline")


def _generate(cluster: Cluster, request_id: str) -> list[int]:
    async def run():
        tokens = []
        async for delta in cluster.generate(request_id, cluster.tokenizer.encode(PROMPT), GREEDY):
            tokens += delta.new_token_ids
        return tokens

    return cluster.test_loop.run_until_complete(asyncio.wait_for(run(), request_bound_s(cluster)))


def restart_bound_s(cluster: Cluster) -> float:
    """How long a killed rank may take to serve again: Ray restarts it and it loads within deploy's own
    wait for an actor (`ready_timeout_s`, after which the monitor kills the restart as overdue), then a
    probe finds it answering and rewires it."""
    return ready_timeout_s(cluster.topology) + 2 * (PROBE_INTERVAL_S + call_bound_s(cluster))


def _pid(cluster: Cluster, role: str, index: int = 0) -> int:
    import ray

    actors = cluster.prefill_actors if role == "prefill" else cluster.decode_actors
    return ray.get(actors[index].load.remote(), timeout=cluster.call_timeout_s).pid


def _seconds_until_routable(cluster: Cluster, role: str, bound_s: float) -> float:
    started_s = time.monotonic()
    while not cluster.registry.routable(role)[0]:
        assert time.monotonic() - started_s < bound_s, cluster.health()
        time.sleep(0.05)
    return time.monotonic() - started_s


@contextlib.contextmanager
def _decode_watchdog(cluster: Cluster, watchdog_s: float):
    """Decode's `engine_watchdog_s` at `watchdog_s` within the block (the monitor reads it at each probe)."""
    before = cluster.topology
    cluster.topology = dataclasses.replace(
        before, decode=dataclasses.replace(before.decode, engine_watchdog_s=watchdog_s)
    )
    try:
        yield
    finally:
        cluster.topology = before


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_stalled_instance_leaves_routing_and_rejoins_when_it_answers(
    cluster, expected_tokens, role
) -> None:
    """SIGSTOP for longer than the call timeout, shorter than the pool's engine watchdog (300 s: decode's
    2 s of this module is raised for this test): a request fails with BackendUnavailable naming the stalled
    instance (no hang), `check_ready` (/health) and stats() raise naming it, the instance is reported
    "unresponsive", not dead. After SIGCONT it rejoins routing within two probes (the first answer may
    still carry the pass the pause interrupted, longer than a call may take) and serves the same greedy
    tokens as before, from the same process, with nothing left held."""
    pid = _pid(cluster, role)
    cluster.check_ready()
    with _decode_watchdog(cluster, 300.0):
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(BackendUnavailable, match=f"{role}-0"):
                _generate(cluster, f"during-{role}-stall")
            with pytest.raises(BackendUnavailable, match=f"{role}-0 unresponsive"):
                cluster.check_ready()  # /health's answer, from what the failed call recorded (no call)
            with pytest.raises(BackendUnavailable, match=f"{role}-0 unresponsive"):
                cluster.stats()
            assert cluster.health()[f"{role}-0"]["state"] == "unresponsive"
            time.sleep(call_bound_s(cluster))  # stalled past a few probes: still not declared dead
            assert cluster.health()[f"{role}-0"]["state"] == "unresponsive"
        finally:
            os.kill(pid, signal.SIGCONT)
        bound_s = 2 * (PROBE_INTERVAL_S + call_bound_s(cluster))
        recovery_s = _seconds_until_routable(cluster, role, bound_s)
    print(f"{role} rejoined {recovery_s:.2f} s after SIGCONT")
    assert _pid(cluster, role) == pid  # the same process, not a restart
    assert _generate(cluster, f"after-{role}-stall") == expected_tokens
    cluster.stats()  # healthy again: no BackendUnavailable
    cluster.check_ready()
    assert_nothing_held(cluster)


def test_a_decode_silent_past_its_engine_watchdog_is_killed_restarted_and_serves_again(
    cluster, expected_tokens, caplog
) -> None:
    """SIGSTOP of decode that never ends (from outside, a native call hung holding the GIL looks the same):
    a request fails with BackendUnavailable naming it; once it has answered nothing for its
    engine_watchdog_s (2 s here; at least two unanswered probes) the monitor kills it for Ray to restart
    (SIGKILL ends a stopped process), and the new process is rewired, rejoins routing once and serves the
    same greedy tokens."""
    pid = _pid(cluster, "decode")
    os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level("WARNING", logger="pdcluster.driver.cluster"):
            with pytest.raises(BackendUnavailable, match="decode-0"):
                _generate(cluster, "during-decode-silence")
            # Silent for the watchdog, at least two unanswered probes (the monitor's floor), seen so at a
            # probe; then a restart loads the weights again.
            floor_s = 2 * (cluster.call_timeout_s + PROBE_INTERVAL_S)
            probes_s = max(ENGINE_WATCHDOG_S, floor_s) + 2 * (PROBE_INTERVAL_S + call_bound_s(cluster))
            recovery_s = _seconds_until_routable_after_restart(
                cluster, "decode", pid, probes_s + restart_bound_s(cluster)
            )
        assert _process_ended(pid), "the stopped process was left behind"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # only if the test failed before the kill
    print(f"silent decode killed, restarted and back {recovery_s:.2f} s after the request failed")
    assert "decode-0: killing its actor for Ray to restart it (it has answered no call for" in caplog.text
    rejoins = [r.getMessage() for r in caplog.records if "decode-0 rejoined routing" in r.getMessage()]
    assert len(rejoins) == 1 and rejoins[0].endswith("(restarted and rewired)"), rejoins
    assert _pid(cluster, "decode") != pid
    assert _generate(cluster, "after-decode-silence") == expected_tokens
    assert_nothing_held(cluster)


def test_a_crashed_decode_is_restarted_rewired_and_serves_again(cluster, expected_tokens) -> None:
    """SIGKILL of the decode actor's process: Ray restarts it in its placement group bundle (a new
    process, weights loaded again); the health monitor rewires prefill's KV sender to the new receiver and
    puts it back in routing; the same greedy tokens come out. The driver's client of the rank starts over
    (the new process numbers its events from 1)."""
    pid = _pid(cluster, "decode")
    client = cluster.instances["decode"][0].client(0)
    stream_before = client._stream
    os.kill(pid, signal.SIGKILL)
    recovery_s = _seconds_until_routable_after_restart(cluster, "decode", pid, restart_bound_s(cluster))
    print(f"decode restarted and rejoined {recovery_s:.2f} s after SIGKILL")
    assert _pid(cluster, "decode") != pid
    assert cluster.instances["decode"][0].client(0) is client and client._stream != stream_before
    assert _generate(cluster, "after-crash") == expected_tokens
    assert client.acked_seq > 0
    assert_nothing_held(cluster)


def test_a_crashed_prefill_is_restarted_and_takes_a_new_command_stream(cluster, expected_tokens) -> None:
    """SIGKILL of the prefill actor's process: Ray restarts it; the health monitor rewires its KV senders
    and the driver's client of the rank starts a new command stream (the new process has seen none), on
    which the next request and its bind go in order; the same greedy tokens come out."""
    pid = _pid(cluster, "prefill")
    client = cluster.instances["prefill"][0].client(0)
    stream_before = client._stream
    os.kill(pid, signal.SIGKILL)
    recovery_s = _seconds_until_routable_after_restart(cluster, "prefill", pid, restart_bound_s(cluster))
    print(f"prefill restarted and rejoined {recovery_s:.2f} s after SIGKILL")
    assert _pid(cluster, "prefill") != pid
    assert client._stream != stream_before
    assert _generate(cluster, "after-prefill-crash") == expected_tokens
    assert client._seq >= 2  # its prefill and its bind, numbered in the new stream
    assert_nothing_held(cluster)


def test_a_decode_engine_stuck_in_one_pass_is_failed_and_restarted(cluster, expected_tokens, caplog) -> None:
    """The decode engine thread hangs in one pass holding its engine lock (inject_stall: a deadlock, a
    kernel that never returns), so its reserves wait and time out while `load` still answers (the probes'
    own concurrency group): the request ends with BackendUnavailable naming decode-0, not a hang; the
    instance does not rejoin routing while the pass runs (its next reserve would time out again); the
    engine watchdog fails it, kills the actor for Ray to restart, and the new process is rewired and
    serves the same greedy tokens."""
    import ray

    pid = _pid(cluster, "decode")
    stall_s = 10 * request_bound_s(cluster)  # never ends by itself within the test
    with caplog.at_level("WARNING", logger="pdcluster.driver.cluster"):
        ray.get(cluster.decode_actors[0].inject_stall.remote(stall_s), timeout=cluster.call_timeout_s)
        with pytest.raises(BackendUnavailable, match="decode-0"):
            _generate(cluster, "during-engine-stall")
        # The pass runs over ENGINE_WATCHDOG_S, is seen so for min(ENGINE_WATCHDOG_S, STUCK_CONFIRM_S)
        # more at the probes, then a restart loads the weights again (bounded as in the crash test).
        probes_s = 2 * ENGINE_WATCHDOG_S + 2 * (PROBE_INTERVAL_S + call_bound_s(cluster))
        recovery_s = _seconds_until_routable_after_restart(
            cluster, "decode", pid, probes_s + restart_bound_s(cluster)
        )
    print(f"decode failed by the watchdog, restarted and back {recovery_s:.2f} s after the request failed")
    failed = "decode-0 is dead (probe: EngineFailed: decode-0: its engine thread has been in one pass of its"
    assert failed in caplog.text
    assert "decode-0: killing its actor for Ray to restart it (its engine failed)" in caplog.text
    rejoins = [r.getMessage() for r in caplog.records if "decode-0 rejoined routing" in r.getMessage()]
    assert len(rejoins) == 1 and rejoins[0].endswith("(restarted and rewired)"), rejoins  # no flapping
    assert _pid(cluster, "decode") != pid
    assert _generate(cluster, "after-engine-stall") == expected_tokens
    assert_nothing_held(cluster)


def _process_ended(pid: int) -> bool:
    """Process `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def _seconds_until_routable_after_restart(cluster: Cluster, role: str, old_pid: int, bound_s: float) -> float:
    started_s = time.monotonic()
    while True:
        health = cluster.registry.health_of(role)[0]
        if health.routable and health.pid != old_pid:
            return time.monotonic() - started_s
        assert time.monotonic() - started_s < bound_s, cluster.health()
        time.sleep(0.05)
