"""The instance health policy (driver.health): pure transitions, no Ray."""

from __future__ import annotations

import dataclasses

import pytest

from pdcluster.driver.health import (
    STUCK_CONFIRM_S,
    Health,
    InstanceHealth,
    ProbeOutcome,
    after_answer,
    after_failure,
    engine_fault,
    is_stale,
    restart_overdue,
    unresponsive_too_long,
)
from pdcluster.driver.messages import DecodeNodeLoad


def test_a_timeout_makes_an_instance_unresponsive_and_an_answer_from_the_same_process_brings_it_back():
    healthy = InstanceHealth(pid=41)
    stalled = after_failure(healthy, ProbeOutcome.TIMED_OUT, "poll: GetTimeoutError", now_s=10.0)
    assert (stalled.state, stalled.reason, stalled.since_s, stalled.routable) == (
        Health.UNRESPONSIVE,
        "poll: GetTimeoutError",
        10.0,
        False,
    )
    # Further timeouts keep the first reason and the time it left routing.
    assert after_failure(stalled, ProbeOutcome.TIMED_OUT, "probe: GetTimeoutError", now_s=12.0) is stalled
    back, needs_rewire = after_answer(stalled, pid=41, now_s=30.0)
    assert back == InstanceHealth(Health.HEALTHY, "", 30.0, 41) and back.routable
    assert not needs_rewire


def test_an_actor_error_makes_it_dead_and_a_new_process_must_be_rewired_before_it_rejoins():
    dead = after_failure(InstanceHealth(pid=41), ProbeOutcome.DIED, "poll: ActorDiedError", now_s=5.0)
    assert dead.state is Health.DEAD and not dead.routable
    # A timeout while dead (Ray restarting it) does not make it "only stalled".
    assert after_failure(dead, ProbeOutcome.TIMED_OUT, "probe: GetTimeoutError", now_s=6.0) is dead
    back, needs_rewire = after_answer(dead, pid=97, now_s=20.0)
    assert needs_rewire and back.state is Health.HEALTHY and back.pid == 97


def test_stalled_then_died_is_dead_and_a_healthy_instance_seen_from_a_new_process_needs_rewiring():
    stalled = after_failure(InstanceHealth(pid=1), ProbeOutcome.TIMED_OUT, "load: timeout", now_s=1.0)
    assert after_failure(stalled, ProbeOutcome.DIED, "probe: ActorDiedError", now_s=2.0).state is Health.DEAD
    healthy = InstanceHealth(pid=1)
    assert after_answer(healthy, pid=1, now_s=3.0) == (healthy, False)
    assert after_answer(InstanceHealth(), pid=5, now_s=3.0) == (InstanceHealth(pid=5), False)  # first sight
    restarted, needs_rewire = after_answer(healthy, pid=2, now_s=3.0)  # restarted between two calls
    assert needs_rewire and restarted.pid == 2


def test_after_failure_refuses_an_answer():
    with pytest.raises(ValueError, match="after_answer"):
        after_failure(InstanceHealth(), ProbeOutcome.ANSWERED, "", now_s=0.0)


def test_a_failure_of_a_call_sent_before_the_instance_rejoined_is_stale():
    rejoined = InstanceHealth(Health.HEALTHY, "", since_s=30.0, pid=41)
    assert is_stale(rejoined, issued_at_s=29.9)  # sent before the probe that brought it back answered
    assert not is_stale(rejoined, issued_at_s=30.1)
    assert not is_stale(rejoined, issued_at_s=None)  # unknown: applied
    stalled = InstanceHealth(Health.UNRESPONSIVE, "probe", since_s=30.0, pid=41)
    assert not is_stale(stalled, issued_at_s=29.9)  # out of routing already: nothing to keep


def test_the_monitor_ignores_a_stale_failure_and_applies_the_next_one(caplog):
    """`_mark_failed` with the send time: a timeout of a call sent before the rejoin leaves the instance in
    routing with its loads and requests; the same timeout of a call sent after it takes it out."""
    pytest.importorskip("ray")
    from types import SimpleNamespace

    from pdcluster.driver.registry import InstanceRegistry

    decode = SimpleNamespace(
        pool_state="active", health=InstanceHealth(Health.HEALTHY, "", since_s=30.0, pid=41)
    )
    done: list = []

    def on_failed(role, index, left_routing):  # as `Cluster._on_instance_failed`
        done.append(("forget loads", index))
        if left_routing:
            done.append(("fail attempts", role, index))

    registry = InstanceRegistry({"prefill": [], "decode": [decode]}, 3.0, on_failed)
    monitor = SimpleNamespace(_mark_failed=registry.mark_failed)
    with caplog.at_level("WARNING", logger="pdcluster.driver.cluster"):
        monitor._mark_failed("decode", 0, TimeoutError(), "poll of rank 0", issued_at_s=27.0)
    assert decode.health.routable and done == []
    assert "ignored a failed call (poll of rank 0: no answer within 3 s) sent 3.00 s before" in caplog.text
    monitor._mark_failed("decode", 0, TimeoutError(), "poll of rank 0", issued_at_s=31.0)
    assert decode.health.state is Health.UNRESPONSIVE
    assert decode.health.reason == "poll of rank 0: no answer within 3 s"
    assert done == [("forget loads", 0), ("fail attempts", "decode", 0)]
    # Ray's "unavailable" from a call sent before the rejoin is about the incarnation it went to (one Ray
    # was restarting): ignored, as a timeout. Found by an e2e test, where a poll of a restarting decode
    # failed after the restart had rejoined and took the new incarnation out of routing.
    ray = pytest.importorskip("ray")

    decode.health = InstanceHealth(Health.HEALTHY, "", since_s=30.0, pid=41)
    done.clear()
    restarting = ray.exceptions.ActorUnavailableError("IOError: The actor is restarting.", None)
    monitor._mark_failed("decode", 0, restarting, "poll of rank 0", issued_at_s=27.0)
    assert decode.health.routable and done == []
    monitor._mark_failed("decode", 0, restarting, "poll of rank 0", issued_at_s=31.0)
    assert decode.health.state is Health.DEAD
    # An error saying the actor died is applied even from a call sent before the rejoin: the process may
    # have died after the probe that brought it back answered.
    decode.health = InstanceHealth(Health.HEALTHY, "", since_s=30.0, pid=41)
    monitor._mark_failed("decode", 0, RuntimeError("the actor died"), "reserve", issued_at_s=27.0)
    assert decode.health.state is Health.DEAD


def test_a_failure_recorded_while_an_instance_rejoins_is_not_overwritten(caplog):
    """`_rejoin` rewires (Ray calls, seconds) before it puts the instance back: an actor-died error the
    request path records meanwhile stands (the instance stays out of routing); without one it rejoins."""
    pytest.importorskip("ray")
    from types import SimpleNamespace

    prefill = SimpleNamespace(
        pool_state="active",
        health=InstanceHealth(Health.UNRESPONSIVE, "probe", since_s=30.0, pid=41),
        clients=[],
    )
    failed: list = []
    # prefill is rewired when it rejoins (shm)
    monitor = _new_monitor({"prefill": [prefill], "decode": []}, SimpleNamespace(kv_transport="shm"))
    monitor.registry.on_failed = lambda role, index, left_routing: failed.append((role, index))

    def rewire_while_the_actor_dies(ray, role, index, needs_rewire):
        monitor.registry.mark_failed(role, index, RuntimeError("the actor died"), "prefill")

    monitor.deployment.rewire = rewire_while_the_actor_dies
    with caplog.at_level("WARNING", logger="pdcluster.driver.cluster"):
        monitor._rejoin("prefill", 0, pid=41)
    assert prefill.health.state is Health.DEAD and not prefill.health.routable
    assert failed == [("prefill", 0)]
    assert "prefill-0 answered a probe but became dead" in caplog.text
    monitor.deployment.rewire = lambda ray, role, index, needs_rewire: None
    monitor._rejoin("prefill", 0, pid=41)  # the next probe: the same process answers, nothing fails
    assert prefill.health.state is Health.HEALTHY and prefill.health.pid == 41


def test_errors_for_clients_carry_no_ray_internals():
    """What a client hears (BackendUnavailable, /health) names what happened, not actor ids, pids, IPs."""
    ray = pytest.importorskip("ray")
    from pdcluster.driver.cluster import describe_error

    unavailable = ray.exceptions.ActorUnavailableError("connection lost", b"\x01" * 16)
    assert "0101" in str(unavailable)  # Ray's own text has the actor id
    assert describe_error(unavailable) == "the actor is unavailable (restarting or unreachable)"
    assert describe_error(ray.exceptions.ActorDiedError()) == "the actor process died"
    assert describe_error(ray.exceptions.GetTimeoutError("Get timed out")) == "no answer in time"
    try:
        raise ValueError("top_p must be in (0, 1], got 0.0\nsecond line")
    except ValueError as cause:
        raised = ray.exceptions.RayTaskError("prefill", "Traceback ... pid=4242, ip=10.1.2.3", cause)
    assert "pid=" in str(raised)  # Ray adds the raising process id and node IP
    assert describe_error(raised).startswith("ValueError: top_p must be in (0, 1], got 0.0")
    assert "pid=" not in describe_error(raised)


def _load(pid=41, passes=7, pass_s=0.0, alive=True, error=None) -> DecodeNodeLoad:
    return DecodeNodeLoad(
        name="decode-0",
        pid=pid,
        num_free_blocks=10,
        num_total_blocks=10,
        num_running=1,
        num_reserved=0,
        num_waiting_for_seat=0,
        engine_thread_alive=alive,
        num_engine_errors=0 if error is None else 1,
        last_engine_error=error,
        engine_passes=passes,
        engine_pass_s=pass_s,
    )


def test_the_engine_watchdog_fails_a_pass_still_stuck_after_the_confirmation_time():
    """Over the watchdog at one probe is remembered with the driver's time, not failed (a process paused
    whole answers first with its pre-pause pass); the same pass of the same process still over it
    min(watchdog, STUCK_CONFIRM_S) later is a fault."""
    assert engine_fault(_load(pass_s=0.02), 10.0, None, now_s=100.0) == (None, None)
    fault, stuck = engine_fault(_load(pass_s=12.0), 10.0, None, now_s=100.0)
    assert fault is None and stuck == (41, 7, 100.0)
    assert engine_fault(_load(pass_s=13.0), 10.0, stuck, now_s=109.9) == (None, stuck)  # not yet
    fault, still = engine_fault(_load(pass_s=22.0), 10.0, stuck, now_s=110.0)
    assert fault == (
        "decode-0: its engine thread has been in one pass of its loop for 22.0 s (engine_watchdog_s 10)"
    )
    assert still == stuck
    # The confirmation time is at most STUCK_CONFIRM_S, however long the watchdog.
    assert STUCK_CONFIRM_S < 300.0
    stuck = (41, 7, 100.0)
    assert engine_fault(_load(pass_s=301.0), 300.0, stuck, now_s=100.0 + STUCK_CONFIRM_S)[0] is not None
    # The loop moved on (a new pass), or a new process numbers its passes from 1: remembered afresh.
    assert engine_fault(_load(passes=8, pass_s=12.0), 10.0, stuck, now_s=120.0) == (None, (41, 8, 120.0))
    assert engine_fault(_load(pid=42, pass_s=12.0), 10.0, stuck, now_s=120.0) == (None, (42, 7, 120.0))
    assert engine_fault(_load(pass_s=3.0), 10.0, stuck, now_s=120.0) == (None, None)  # it passes again


def test_the_engine_watchdog_fails_a_dead_engine_thread_at_once():
    dead = _load(alive=False, error="decode step failed: MemoryError()")
    fault, stuck = engine_fault(dead, 10.0, None, now_s=100.0)
    assert fault == "decode-0: its engine thread died (last error: decode step failed: MemoryError())"
    assert stuck is None


def _watchdog_monitor(kv_transport: str, num_ranks: int, watchdog_s: float = 10.0):
    from types import SimpleNamespace

    pool = SimpleNamespace(engine_watchdog_s=watchdog_s)
    topology = SimpleNamespace(
        kv_transport=kv_transport, pool=lambda role: pool, compiles=lambda role: role == "decode"
    )
    monitor = _new_monitor({"prefill": [], "decode": []}, topology)
    instance = SimpleNamespace(
        role="decode", index=0, ranks=[f"actor-{r}" for r in range(num_ranks)], num_deployed_ranks=num_ranks
    )
    return monitor, instance


def test_the_monitor_has_ray_restart_a_failed_engine_once_per_process(caplog):
    pytest.importorskip("ray")
    import time
    from types import SimpleNamespace

    from pdcluster.driver.actor_errors import EngineFailed

    monitor, instance = _watchdog_monitor("shm", num_ranks=1, watchdog_s=0.05)  # confirmed after 0.05 s
    monitor._check_engines(instance, [_load(pass_s=11.0)])  # first sighting: remembered
    assert monitor._stuck_passes["decode-0"][:2] == (41, 7)
    time.sleep(0.06)
    with pytest.raises(EngineFailed, match="one pass of its loop for 12.0 s") as failed:
        monitor._check_engines(instance, [_load(pass_s=12.0)])
    assert failed.value.pid == 41
    killed, refusals = [], [RuntimeError("the GCS is busy")]

    def kill(actor, no_restart):
        if refusals:
            raise refusals.pop()
        killed.append((actor, no_restart))

    with caplog.at_level("WARNING", logger="pdcluster.driver.cluster"):
        monitor._restart_failed_engine(SimpleNamespace(kill=kill), instance, failed.value.pid)
        assert killed == [] and "killing its actor failed (RuntimeError('the GCS is busy'))" in caplog.text
        monitor._restart_failed_engine(SimpleNamespace(kill=kill), instance, failed.value.pid)  # tried again
        monitor._restart_failed_engine(SimpleNamespace(kill=kill), instance, failed.value.pid)  # done already
    assert killed == [("actor-0", False)]  # once it went through, and restartable
    assert "decode-0: killing its actor for Ray to restart it (its engine failed)" in caplog.text
    monitor._check_engines(instance, [_load(pid=42, passes=3)])  # the restarted process passes: no fault
    assert monitor._stuck_passes == {}


def test_the_monitor_names_the_rank_whose_engine_failed_not_the_ranks_waiting_for_it():
    """In lockstep every rank's pass runs long when one hangs (the others wait in its collectives): the
    fault names a dead engine thread first, else the longest pass."""
    pytest.importorskip("ray")
    import dataclasses
    import time

    from pdcluster.driver.actor_errors import EngineFailed

    monitor, instance = _watchdog_monitor("shm", num_ranks=2, watchdog_s=0.05)
    ranks = [_load(pass_s=5.0), dataclasses.replace(_load(pid=43, pass_s=9.0), name="decode-0.1")]
    monitor._check_engines(instance, ranks)
    time.sleep(0.06)
    with pytest.raises(EngineFailed, match=r"^decode-0\.1: its engine thread has been in one pass") as failed:
        monitor._check_engines(instance, ranks)
    assert failed.value.pid == 41  # the leader's process: the instance is restarted as one unit
    ranks[0] = _load(alive=False)
    with pytest.raises(EngineFailed, match=r"^decode-0: its engine thread died"):
        monitor._check_engines(instance, ranks)


def test_an_instance_ray_does_not_restart_is_left_out_of_routing_not_killed(caplog):
    pytest.importorskip("ray")
    from types import SimpleNamespace

    killed = []
    ray = SimpleNamespace(kill=lambda actor, no_restart: killed.append(actor))
    for transport, num_ranks, deployed_ranks in (("torch_distributed", 1, 1), ("shm", 2, 2), ("shm", 1, 2)):
        monitor, instance = _watchdog_monitor(transport, num_ranks)
        instance.num_deployed_ranks = deployed_ranks  # (shm, 1 of 2): an EP2 instance elastic EP shrank
        with caplog.at_level("ERROR", logger="pdcluster.driver.cluster"):
            monitor._restart_failed_engine(ray, instance, pid=41)
        assert (
            f"decode-0: its engine failed, but Ray does not restart its actors (kv_transfer {transport}, "
            f"{deployed_ranks} ranks deployed)" in caplog.text
        )
    assert killed == []


def test_a_shrunk_instance_whose_last_rank_died_gets_no_one_rank_replacement():
    """An EP2 instance shrunk to one rank (elastic EP) whose last rank dies: its actor was deployed
    with an EP config a one-rank actor refuses, so no replacement is started in its place."""
    pytest.importorskip("ray")
    from types import SimpleNamespace

    monitor, instance = _watchdog_monitor("shm", num_ranks=1)
    instance.num_deployed_ranks, instance.health = 2, SimpleNamespace(since_s=0.0)  # died long ago
    ray = SimpleNamespace(kill=lambda actor, no_restart: pytest.fail(f"killed {actor}"))
    monitor._replace_if_given_up(ray, instance, RuntimeError("the actor died"))
    assert instance.ranks == ["actor-0"] and monitor._replacements == {}


class _FakeRank:
    """A rank actor as `run_round` calls it: `load.options(concurrency_group=...).remote()`; the "object
    ref" is the answer itself (a load, or the exception `ray.get` raises)."""

    def __init__(self, answer) -> None:
        self.answer, self.groups = answer, []

    @property
    def load(self):
        rank = self

        class Method:
            def options(self, concurrency_group):
                rank.groups.append(concurrency_group)
                return self

            def remote(self):
                return rank.answer

        return Method()


def _probing_monitor(monkeypatch, answer, health: InstanceHealth, watchdog_s: float = 10.0):
    ray = pytest.importorskip("ray")
    from types import SimpleNamespace

    def get(ref, timeout):
        if isinstance(ref, BaseException):
            raise ref
        return ref

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: done.append(("kill", no_restart)))
    done: list = []
    rank = _FakeRank(answer)

    class FakeInstance(SimpleNamespace):
        routable = property(lambda self: self.health.routable)
        pool_state = "active"  # (dynamic P:D: in its pool)
        name, home = "decode-0", ""  # (home: its deploy name when a role move made this slot)
        num_deployed_ranks = 1

        def rank_name(self, r):
            return "decode-0" if r == 0 else f"decode-0.{r}"

    instance = FakeInstance(role="decode", index=0, ranks=[rank], health=health)
    monitor, _ = _watchdog_monitor("shm", num_ranks=1, watchdog_s=watchdog_s)
    monitor.registry.instances = {"prefill": [], "decode": [instance]}
    monitor._loads = SimpleNamespace(
        update_decode=lambda ref, load: None, forget_decode=lambda index: done.append(("forget", index))
    )
    monitor._fail_attempts = lambda role, index: done.append(("fail attempts", role, index))
    monitor._rejoin = lambda role, index, pid: done.append(("rejoin", role, index, pid))
    return monitor, instance, rank, done


def test_probes_use_their_own_concurrency_group_and_no_rejoin_while_a_pass_outlasts_a_call(monkeypatch):
    """An instance out of routing whose rank answers mid-pass longer than a call may take stays out (its
    calls that wait for the engine would time out again); once that pass ends it rejoins. Every probe goes
    to the probe concurrency group, which calls blocked behind the engine cannot take."""
    from pdcluster.driver.rank_actors import PROBE_GROUP

    out = InstanceHealth(Health.UNRESPONSIVE, "reserve: no answer within 3 s", since_s=30.0, pid=41)
    monitor, instance, rank, done = _probing_monitor(monkeypatch, _load(pass_s=5.0), out)
    monitor.run_round()
    assert done == [] and not instance.routable
    rank.answer = _load(passes=8, pass_s=0.01)
    monitor.run_round()
    assert done == [("rejoin", "decode", 0, 41)]
    assert rank.groups == [PROBE_GROUP, PROBE_GROUP]


def test_a_probe_fails_a_stuck_engine_kills_it_once_and_an_unanswered_probe_forgets_the_sighting(monkeypatch):
    import time

    healthy = InstanceHealth(Health.HEALTHY, "", since_s=30.0, pid=41)
    monitor, instance, rank, done = _probing_monitor(monkeypatch, _load(pass_s=1.0), healthy, watchdog_s=0.05)
    monitor.run_round()  # first sighting
    assert instance.routable and "decode-0" in monitor._stuck_passes
    rank.answer = TimeoutError("no answer")  # paused: the sighting is forgotten, the instance unresponsive
    monitor.run_round()
    assert monitor._stuck_passes == {} and instance.health.state is Health.UNRESPONSIVE
    rank.answer = _load(pass_s=2.0)  # resumed mid-pass: sighted afresh, not failed at once
    monitor.run_round()
    assert instance.health.state is Health.UNRESPONSIVE and ("kill", False) not in done
    time.sleep(0.06)
    monitor.run_round()  # the same pass, still stuck: failed as dead and killed for Ray to restart
    monitor.run_round()
    assert instance.health.state is Health.DEAD and "EngineFailed" in instance.health.reason
    assert done.count(("kill", False)) == 1


def test_an_instance_silent_past_the_watchdog_is_unresponsive_too_long():
    """Counted from when it became UNRESPONSIVE or last answered a probe, whichever is later, on the
    driver's clock, against the watchdog and the monitor's floor; never for a healthy or dead instance,
    nor one whose process was never seen (nothing to restart)."""
    silent = InstanceHealth(Health.UNRESPONSIVE, "reserve: no answer within 3 s", since_s=100.0, pid=41)
    assert unresponsive_too_long(silent, 20.0, now_s=119.9, last_answer_s=0.0, min_silent_s=8.0) is None
    why = unresponsive_too_long(silent, 20.0, now_s=120.0, last_answer_s=0.0, min_silent_s=8.0)
    assert why == (
        "it has answered no call for 20.0 s (engine_watchdog_s 20; unresponsive since: reserve: no answer "
        "within 3 s)"
    )
    # it answered a probe at 110 s (mid-pass, not back in routing): silent for 10 s only
    assert unresponsive_too_long(silent, 20.0, now_s=120.0, last_answer_s=110.0, min_silent_s=8.0) is None
    assert unresponsive_too_long(silent, 20.0, now_s=130.0, last_answer_s=110.0, min_silent_s=8.0)
    # a watchdog shorter than the floor (two unanswered probes) waits for the floor
    assert unresponsive_too_long(silent, 2.0, now_s=107.9, last_answer_s=0.0, min_silent_s=8.0) is None
    assert unresponsive_too_long(silent, 2.0, now_s=108.0, last_answer_s=0.0, min_silent_s=8.0)
    assert unresponsive_too_long(dataclasses.replace(silent, pid=None), 20.0, 500.0, 0.0, 8.0) is None
    for state in (Health.HEALTHY, Health.DEAD):
        assert unresponsive_too_long(dataclasses.replace(silent, state=state), 20.0, 500.0, 0.0, 8.0) is None


def _silent_monitor(monkeypatch, watchdog_s: float):
    """`_probing_monitor` for an instance UNRESPONSIVE since now whose probes time out, with a call timeout
    and probe interval short enough that the floor (two unanswered probes) is 0.1 s."""
    import time

    from pdcluster.driver import health_monitor

    silent = InstanceHealth(Health.UNRESPONSIVE, "probe: no answer within 3 s", time.monotonic(), pid=41)
    monitor, instance, rank, done = _probing_monitor(
        monkeypatch, TimeoutError("no answer"), silent, watchdog_s
    )
    monitor.call_timeout_s = 0.025
    monkeypatch.setattr(health_monitor, "PROBE_INTERVAL_S", 0.025)
    return monitor, instance, rank, done


def test_an_instance_that_answers_no_probe_past_the_watchdog_is_killed_once_for_ray_to_restart(
    monkeypatch, caplog
):
    """A process that stopped answering altogether (a native call hung holding the GIL) never reports a
    stuck pass: past `engine_watchdog_s` of silence the monitor kills it, once for that process; Ray's
    restart then answers from a new process, which rejoins (rewired) as after a crash."""
    import time

    monitor, instance, rank, done = _silent_monitor(monkeypatch, watchdog_s=0.2)
    monitor.run_round()
    assert ("kill", False) not in done  # silent for less than the watchdog
    time.sleep(0.25)
    with caplog.at_level("ERROR", logger="pdcluster.driver.cluster"):
        monitor.run_round()
        monitor.run_round()
    assert done.count(("kill", False)) == 1
    assert "decode-0: killing its actor for Ray to restart it (it has answered no call for" in caplog.text
    rank.answer = _load(pid=42)  # the restarted process
    monitor.run_round()
    assert done[-1] == ("rejoin", "decode", 0, 42)


def test_an_answered_probe_restarts_the_silence_and_no_kill_after_close(monkeypatch):
    """An instance out of routing that answers mid-pass (so it does not rejoin) is alive: one unanswered
    probe after that is not silence past the watchdog. After `close()` nothing is killed."""
    import time

    monitor, instance, rank, done = _silent_monitor(monkeypatch, watchdog_s=0.2)
    time.sleep(0.25)
    rank.answer = _load(pass_s=5.0)  # longer than a call may take: answers, stays out of routing
    monitor.run_round()
    assert not instance.routable and ("rejoin", "decode", 0, 41) not in done
    rank.answer = TimeoutError("no answer")
    monitor.run_round()
    assert ("kill", False) not in done
    time.sleep(0.25)
    monitor._stop.set()  # close()
    monitor.run_round()
    assert ("kill", False) not in done
    monitor._stop.clear()
    monitor.run_round()
    assert done.count(("kill", False)) == 1


def test_a_dead_instance_whose_restart_answers_nothing_past_the_start_timeout_is_restart_overdue():
    """Counted from when it became DEAD, its last answer or the monitor's last kill, whichever is later,
    against the start timeout; never for an instance that is not DEAD."""
    dead = InstanceHealth(Health.DEAD, "probe: ActorDiedError: killed", since_s=100.0, pid=41)
    assert restart_overdue(dead, 300.0, now_s=399.9, last_sign_s=0.0) is None
    assert restart_overdue(dead, 300.0, now_s=400.0, last_sign_s=0.0) == (
        "its restart has answered no call for 300.0 s (a rank must load within 300 s; dead since: probe: "
        "ActorDiedError: killed)"
    )
    assert restart_overdue(dead, 300.0, now_s=449.9, last_sign_s=150.0) is None  # killed again at 150 s
    assert restart_overdue(dead, 300.0, now_s=450.0, last_sign_s=150.0) == (
        "its restart has answered no call for 300.0 s (a rank must load within 300 s; dead since: probe: "
        "ActorDiedError: killed)"
    )
    for state in (Health.HEALTHY, Health.UNRESPONSIVE):
        assert restart_overdue(dataclasses.replace(dead, state=state), 300.0, 1000.0, 0.0) is None


def test_a_restart_that_never_answers_is_killed_once_after_deploys_load_timeout(monkeypatch, caplog):
    """The decode instance was killed for Ray to restart it (process 41), and the restart hangs: probes to
    it fail with Ray's "the actor is restarting" (or time out). Once they have for deploy's load timeout
    (`ready_timeout_s`: with a pool that compiles, its compile time too) since that kill, the monitor kills
    the hanging incarnation, although process 41 was killed before; but only once in that death: a
    second restart that hangs stays out of routing. A restart that answers rejoins, and in a later death
    an overdue restart is killed again. (The monitor's clock is a fake one, so that a busy machine cannot
    move a probe past a deadline; Ray's errors are constructed, the e2e test in
    tests/cluster/test_restart_hang.py gets them from Ray.)"""
    from types import SimpleNamespace

    ray = pytest.importorskip("ray")
    from pdcluster.driver import health_monitor, rank_actors

    restarting = ray.exceptions.ActorUnavailableError("IOError: The actor is restarting.", None)
    clock = [1000.0]
    monkeypatch.setattr(health_monitor, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(rank_actors, "ACTORS_READY_TIMEOUT_S", 100.0)
    monkeypatch.setattr(rank_actors, "COMPILE_READY_TIMEOUT_S", 50.0)  # the decode pool compiles: 150 s
    dead = InstanceHealth(Health.DEAD, "probe: EngineFailed: stuck", since_s=990.0, pid=41)
    monitor, instance, rank, done = _probing_monitor(monkeypatch, restarting, dead)
    monitor._engine_restarts[("decode", 0)] = 41
    monitor._last_kill_s[("decode", 0)] = 1000.0
    clock[0] = 1149.9
    monitor.run_round()
    assert ("kill", False) not in done
    clock[0] = 1150.0
    with caplog.at_level("WARNING", logger="pdcluster.driver.cluster"):
        monitor.run_round()
        monitor.run_round()
    assert done.count(("kill", False)) == 1
    assert (
        "decode-0: killing its actor for Ray to restart it (its restart has answered no call for 150.0 s (a "
        "rank must load within 150 s; dead since: probe: EngineFailed: stuck))" in caplog.text
    )
    assert "decode-0: if this restart hangs too, it is not killed again" in caplog.text
    assert monitor._last_kill_s[("decode", 0)] == 1150.0
    clock[0] = 1400.0  # the next restart hangs too: the same death, not killed again
    monitor.run_round()
    assert done.count(("kill", False)) == 1
    rank.answer = _load(pid=43)
    monitor.run_round()
    assert done[-1] == ("rejoin", "decode", 0, 43)
    # a later death (the fake `_rejoin` did not change the health: a new DEAD episode by hand)
    instance.health = InstanceHealth(Health.DEAD, "probe: the actor process died", since_s=2000.0, pid=43)
    rank.answer = TimeoutError("no answer")
    clock[0] = 2149.9
    monitor.run_round()
    assert done.count(("kill", False)) == 1
    clock[0] = 2150.0
    monitor.run_round()
    assert done.count(("kill", False)) == 2


def test_failing_attempts_queued_before_a_shutdown_still_ends_them(monkeypatch):
    """The dispatcher's `fail_attempts` (the monitor's callback) goes to the requests' event loop with
    the reason it sees; failed after the cluster shut down (its instances gone), the attempt still gets
    its DecodeLost naming the shutdown, and nothing raises IndexError."""
    from types import SimpleNamespace

    from pdcluster.driver.messages import DecodeLost
    from pdcluster.driver.request_dispatch import Dispatcher
    from pdcluster.driver.request_state import Attempt
    from pdcluster.driver.router import RankRef

    dispatcher = object.__new__(Dispatcher)
    attempt = Attempt("r@0", RankRef(0, 0), RankRef(0, 0))
    dispatcher.registry = SimpleNamespace(instances={"prefill": [], "decode": []})  # shut down
    dispatcher._by_handoff, dispatcher._loop = {"r@0": attempt}, None
    dispatcher.fail_attempts("decode", 0)
    event = attempt.events.get_nowait()
    assert isinstance(event, DecodeLost)
    assert event.message == "decode-0 died or stopped answering (the cluster shut down); the request was lost"


def test_an_actor_ray_gave_up_on_is_replaced_in_its_bundle_with_backoff_and_a_bound(monkeypatch, caplog):
    """Probes that fail with ActorDiedError (Ray's restarts spent, or a restart whose constructor raised,
    which Ray does not restart): REPLACE_AFTER_S after the death the old actor is killed for good and a new
    one is created for the same instance (`_new_rank_actor`, its placement group bundle); each next
    replacement waits twice as long; after MAX_REPLACEMENTS it stays out of routing, said once. A new
    actor that answers rejoins (rewired: a new process). Neither an actor whose node was preempted (Ray
    restarts it elsewhere) nor an instance Ray does not restart (a multi-rank group) is replaced. (Fake
    clock and Ray calls; the e2e test is in tests/cluster/test_restart_hang.py.)"""
    from types import SimpleNamespace

    ray = pytest.importorskip("ray")
    from pdcluster.driver import health_monitor

    clock = [1000.0]
    monkeypatch.setattr(health_monitor, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(health_monitor, "REPLACE_AFTER_S", 10.0)
    monkeypatch.setattr(health_monitor, "MAX_REPLACEMENTS", 2)
    dead = InstanceHealth(Health.DEAD, "probe: the actor process died", since_s=1000.0, pid=41)
    monitor, instance, rank, done = _probing_monitor(monkeypatch, ray.exceptions.ActorDiedError(), dead)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: done.append(("kill", actor, no_restart)))
    plan = SimpleNamespace(
        instances=[SimpleNamespace(role="prefill", index=0), SimpleNamespace(role="decode", index=0)]
    )
    monitor.deployment._plan = plan
    new_ranks: list[_FakeRank] = []

    def new_rank_actor(ray, spec_index, rank_index):
        new_ranks.append(_FakeRank(ray.exceptions.ActorDiedError()))
        done.append(("new actor", spec_index, rank_index))
        return new_ranks[-1]

    monitor.deployment._new_rank_actor = new_rank_actor
    clock[0] = 1009.9
    monitor.run_round()
    assert [d for d in done if d[0] in ("kill", "new actor")] == []
    clock[0] = 1010.0
    with caplog.at_level("ERROR", logger="pdcluster.driver.cluster"):
        monitor.run_round()
    assert done[-2:] == [("kill", rank, True), ("new actor", 1, 0)] and instance.ranks == [new_ranks[0]]
    assert (
        "decode-0: Ray gave up on its actor (the actor process died); starting a new one in its placement "
        "group (1 of 2)" in caplog.text
    )
    clock[0] = 1029.9  # the new one failed too: the next replacement 20 s after the last
    monitor.run_round()
    assert len(new_ranks) == 1
    clock[0] = 1030.0
    monitor.run_round()
    assert len(new_ranks) == 2 and instance.ranks == [new_ranks[1]]
    clock[0] = 5000.0
    with caplog.at_level("ERROR", logger="pdcluster.driver.cluster"):
        monitor.run_round()
        monitor.run_round()
    assert len(new_ranks) == 2
    assert caplog.text.count("its 2 replacements are spent: it stays out of routing") == 1
    new_ranks[1].answer = _load(pid=44)  # (had the last one come up after all)
    monitor.run_round()
    assert done[-1] == ("rejoin", "decode", 0, 44)

    # the error says the node was preempted: Ray restarts the actor elsewhere, calls fail as died meanwhile
    preempted = ray.exceptions.ActorDiedError()
    preempted._preempted = True
    assert preempted.preempted
    monitor, instance, rank, done = _probing_monitor(monkeypatch, preempted, dead)
    monitor.deployment._plan, monitor.deployment._new_rank_actor = plan, new_rank_actor
    clock[0] = 9000.0
    monitor.run_round()
    assert len(new_ranks) == 2 and instance.ranks == [rank]

    # an instance Ray does not restart: never replaced
    monitor, instance, rank, done = _probing_monitor(monkeypatch, ray.exceptions.ActorDiedError(), dead)
    monitor.topology.kv_transport = "dist"
    monitor.deployment._plan, monitor.deployment._new_rank_actor = plan, new_rank_actor
    clock[0] = 9000.0
    monitor.run_round()
    assert len(new_ranks) == 2 and instance.ranks == [rank]

    # a slot a role move made (deployed as prefill-0): not replaced by another slot's actor, said once
    monitor, instance, rank, done = _probing_monitor(monkeypatch, ray.exceptions.ActorDiedError(), dead)
    instance.home = "prefill-0"
    monitor.deployment._plan, monitor.deployment._new_rank_actor = plan, new_rank_actor
    caplog.clear()
    with caplog.at_level("ERROR", logger="pdcluster.driver.cluster"):
        for _ in range(3):
            clock[0] += 100.0
            monitor.run_round()
    assert len(new_ranks) == 2 and instance.ranks == [rank]
    assert caplog.text.count("decode-0 (deployed as prefill-0): Ray gave up on its actor; a moved") == 1


def _new_monitor(instances: dict, topology, call_timeout_s: float = 3.0):
    """A `HealthMonitor` over fakes: its registry calls `_loads.forget_decode` and `_fail_attempts` on a
    failure as `Cluster._on_instance_failed` does (assign those on the monitor)."""
    from types import SimpleNamespace

    from pdcluster.driver.health_monitor import HealthMonitor
    from pdcluster.driver.registry import InstanceRegistry

    def on_failed(role, index, left_routing):
        if role == "decode":
            monitor._loads.forget_decode(index)
        if left_routing:
            monitor._fail_attempts(role, index)

    registry = InstanceRegistry(instances, call_timeout_s, on_failed)
    deployment = SimpleNamespace(topology=topology, call_timeout_s=call_timeout_s)
    monitor = HealthMonitor(registry, deployment, SimpleNamespace(), lambda role, index: None)
    return monitor
