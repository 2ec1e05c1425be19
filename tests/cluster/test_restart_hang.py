"""Restarts of a crashed decode that do not come up, on a real local Ray (a deployment of its own: these
tests spend the decode actor's Ray restarts, which `test_cluster_recovery`'s tests need): one that hangs
while loading, and one whose constructor raises (Ray then gives up on the actor).

The crash is SIGKILL; the hang is SIGSTOP of Ray's restarted process while it is still in `__init__`; the
failing load reads a checkpoint whose weights file was swapped for a FIFO (the loader refuses a file that
is not regular). Nothing else is faked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from pdcluster.config import load_topology
from pdcluster.driver.cluster import PROBE_INTERVAL_S
from pdcluster.models import bundled_checkpoint_dir
from tests.cluster.conftest import assert_nothing_held, call_bound_s, deployed_with_loop, request_bound_s
from tests.cluster.test_cluster_recovery import (
    _generate,
    _pid,
    _process_ended,
    _seconds_until_routable_after_restart,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint_copy(tmp_path_factory) -> Path:
    """The bundled checkpoint, copied: a test swaps its weights file for a FIFO."""
    path = tmp_path_factory.mktemp("checkpoint") / "tiny"
    shutil.copytree(bundled_checkpoint_dir(), path)
    return path


@pytest.fixture(scope="module")
def cluster(ray_session, checkpoint_copy):
    topo = load_topology("clusters/local.yaml")
    topo = dataclasses.replace(
        topo,
        model=dataclasses.replace(topo.model, path=str(checkpoint_copy)),
        # timeout_s 6: call_timeout_s 3 s, so that the crash is noticed within seconds; eager decode
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=6),
        decode=dataclasses.replace(topo.decode, kv_cache_memory_bytes=16 << 20, compile=False),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
    )
    with deployed_with_loop(topo) as cluster:
        yield cluster


def test_a_decode_restart_that_hangs_is_killed_once_after_the_load_timeout(
    cluster, monkeypatch, caplog
) -> None:
    """SIGKILL of decode, then SIGSTOP of Ray's restart while it is still in `__init__` (loading weights;
    from outside, a load from a file system that stopped answering looks the same): Ray says the actor is
    restarting to every probe. Once that has lasted deploy's load timeout (ACTORS_READY_TIMEOUT_S, 4 s
    here, in the driver) the monitor kills the hanging restart for Ray to start another, which loads, is
    rewired, rejoins once and serves the greedy tokens it served before the crash."""
    from pdcluster.driver import rank_actors

    expected_tokens = _generate(cluster, "before-crash")
    monkeypatch.setattr(rank_actors, "ACTORS_READY_TIMEOUT_S", 4.0)
    pid = _pid(cluster, "decode")
    raylet = _parent(pid)
    hung = None
    try:
        with caplog.at_level("WARNING", logger="pdcluster.driver.cluster"):
            os.kill(pid, signal.SIGKILL)
            hung = _stop_when_loading(raylet, "ray::DecodeWorker.__init__", pid, request_bound_s(cluster))
            overdue = "decode-0: killing its actor for Ray to restart it (its restart has answered no call"
            bound_s = 4.0 + 2 * (PROBE_INTERVAL_S + call_bound_s(cluster)) + request_bound_s(cluster)
            started_s = time.monotonic()
            while cluster.registry.routable("decode")[0]:  # until a probe has found it dead
                assert time.monotonic() - started_s < bound_s, cluster.health()
                time.sleep(0.05)
            while overdue not in caplog.text:
                assert time.monotonic() - started_s < bound_s, cluster.health()
                assert not cluster.registry.routable("decode")[0], "the stopped restart answered"
                time.sleep(0.05)
            # the next restart may take longer than 4 s to load on a busy machine: once per death, it is
            # not killed (asserted below)
            recovery_s = _seconds_until_routable_after_restart(
                cluster, "decode", pid, request_bound_s(cluster)
            )
        assert _process_ended(hung), "the hanging restart was left behind"
    finally:
        if hung is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)  # only if the test failed before the kill
    print(f"hung decode restart killed, and the next one back {recovery_s:.2f} s later")
    rejoins = [r.getMessage() for r in caplog.records if "decode-0 rejoined routing" in r.getMessage()]
    assert len(rejoins) == 1 and rejoins[0].endswith("(restarted and rewired)"), rejoins
    assert caplog.text.count("decode-0: killing its actor") == 1, caplog.text
    assert _pid(cluster, "decode") not in (pid, hung)
    assert _generate(cluster, "after-hung-restart") == expected_tokens
    assert_nothing_held(cluster)


def test_a_decode_ray_gave_up_on_is_replaced_in_its_bundle_and_serves_again(
    cluster, checkpoint_copy, monkeypatch, caplog
) -> None:
    """SIGKILL of decode while its weights file is not a regular file: Ray's restart raises in its
    constructor, and Ray does not restart an actor whose creation failed: it is dead for good, and probes
    say so. With the file back, the monitor's replacement (a new actor in the same placement group
    bundle, REPLACE_AFTER_S = 5 s after the death here) loads, is rewired, rejoins and serves the greedy
    tokens of before; the old actor's process is gone."""
    import ray

    from pdcluster.driver import health_monitor

    monkeypatch.setattr(health_monitor, "REPLACE_AFTER_S", 5.0)
    expected_tokens = _generate(cluster, "before-failed-restart")
    old_actor, pid = cluster.decode_actors[0], _pid(cluster, "decode")
    weights = checkpoint_copy / "model.safetensors"
    kept = weights.rename(checkpoint_copy / "model.safetensors.kept")
    try:
        os.mkfifo(weights)
        with caplog.at_level("WARNING", logger="pdcluster.driver.cluster"):
            os.kill(pid, signal.SIGKILL)
            started_s, bound_s = time.monotonic(), request_bound_s(cluster)
            died = ""
            while "creation task" not in died:  # until the restart failed in its constructor: Ray gave up
                assert time.monotonic() - started_s < bound_s, cluster.health()
                time.sleep(0.1)
                try:
                    ray.get(old_actor.load.remote(), timeout=call_bound_s(cluster))
                except ray.exceptions.ActorDiedError as e:
                    died = str(e)
                except ray.exceptions.RayError:
                    pass
            assert "not a regular file" in died
            weights.unlink()
            kept.rename(weights)
            recovery_s = _seconds_until_routable_after_restart(
                cluster, "decode", pid, 2 * health_monitor.REPLACE_AFTER_S + request_bound_s(cluster)
            )
    finally:
        if kept.exists():
            weights.unlink(missing_ok=True)
            kept.rename(weights)
    print(f"decode replaced and back {recovery_s:.2f} s after its restart failed")
    assert "decode-0: Ray gave up on its actor" in caplog.text
    assert "starting a new one in its placement group (1 of 5)" in caplog.text
    rejoins = [r.getMessage() for r in caplog.records if "decode-0 rejoined routing" in r.getMessage()]
    assert len(rejoins) == 1 and rejoins[0].endswith("(restarted and rewired)"), rejoins
    assert cluster.decode_actors[0] is not old_actor and _process_ended(pid)
    assert _generate(cluster, "after-replacement") == expected_tokens
    assert_nothing_held(cluster)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[1])


def _stop_when_loading(parent: int, title: str, old_pid: int, bound_s: float) -> int:
    """SIGSTOP the first child of `parent` (Ray's raylet) other than `old_pid` whose process title starts
    with `title` (Ray names a worker after the task it runs: `ray::DecodeWorker.__init__` while an actor is
    created); its pid."""
    started_s = time.monotonic()
    while time.monotonic() - started_s < bound_s:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == old_pid:
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
                if cmdline.startswith(title.encode()) and _parent(int(entry)) == parent:
                    os.kill(int(entry), signal.SIGSTOP)
                    return int(entry)
            except (FileNotFoundError, ProcessLookupError):
                continue
        time.sleep(0.005)
    raise AssertionError(f"no {title} under process {parent} within {bound_s:g} s")
