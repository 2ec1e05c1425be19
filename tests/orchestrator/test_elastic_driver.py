"""Elastic EP on the driver: stall detection (a silent rank is probed again, and lost only when that probe
goes unanswered too, for half the round's first wait from when it was sent: the health monitor sends it
halfway through the round), refusals carried through Ray, the rendezvous bundle."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest

from pdcluster.driver.elastic import ElasticInstances, rendezvous_bundle
from pdcluster.driver.elastic_budget import placement_refused
from pdcluster.driver.instance import Instance
from pdcluster.models.elastic_placement import PlacementRefused

ray = pytest.importorskip("ray")
STALL_S, CALL_TIMEOUT_S = 0.4, 2.0  # (ordered as clusters/local-ep.yaml's 5 s and a 15 s call timeout)


def _load(blocked_s: float) -> SimpleNamespace:
    return SimpleNamespace(instance_group_error=None, pid=1, collective_wait_s=blocked_s)


class _Rank:
    """A rank actor's `load` probe answering `answer` after `delay_s` (None: never: a SIGSTOPped rank)."""

    def __init__(self, answer, delay_s: float | None) -> None:
        self.answer, self.delay_s, self.probes = answer, delay_s, 0
        self.load = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=self._remote))

    def _remote(self) -> concurrent.futures.Future:
        self.probes += 1
        ref: concurrent.futures.Future = concurrent.futures.Future()
        if self.delay_s is not None:
            threading.Timer(self.delay_s, ref.set_result, (self.answer,)).start()
        return ref


class _Ray:
    """`ray.get` / `ray.wait` over the futures above; Ray's own exceptions."""

    exceptions = ray.exceptions

    @staticmethod
    def get(ref, timeout):
        try:
            return ref.result(timeout)
        except concurrent.futures.TimeoutError:
            raise ray.exceptions.GetTimeoutError("no answer") from None

    @staticmethod
    def wait(refs, num_returns, timeout):
        done, _ = concurrent.futures.wait(refs, timeout)
        return [r for r in refs if r in done], [r for r in refs if r not in done]


def _elastic() -> ElasticInstances:
    topology = SimpleNamespace(pool=lambda role: SimpleNamespace(elastic_stall_s=STALL_S))
    deployment = SimpleNamespace(topology=topology, call_timeout_s=CALL_TIMEOUT_S)
    return ElasticInstances(deployment, None, lambda *a: None, lambda *a: None)


@pytest.mark.parametrize("peers_blocked_s", [0.1, 2 * STALL_S])
def test_a_rank_answering_late_is_not_lost_though_its_peers_waited_the_stall_time(peers_blocked_s) -> None:
    """Rank 1 missed this round's probe, its peers wait on it (under or over `elastic_stall_s`); probed
    again it answers within half the stall time: slow, not lost."""
    ranks = [_Rank(_load(2 * STALL_S), 0.0), _Rank(_load(0.0), STALL_S / 4), _Rank(_load(2 * STALL_S), 0.0)]
    first = [_load(peers_blocked_s), ray.exceptions.GetTimeoutError("no answer"), _load(peers_blocked_s)]
    loss, outcomes = _elastic().rank_loss(_Ray, Instance("decode", 0, ranks), first)
    assert loss is None and ranks[1].probes == 1
    assert not isinstance(outcomes[1], BaseException)


def test_a_rank_silent_to_its_second_probe_for_the_stall_time_is_lost_before_the_call_timeout() -> None:
    ranks = [_Rank(_load(2 * STALL_S), 0.0), _Rank(_load(0.0), None), _Rank(_load(2 * STALL_S), 0.0)]
    first = [_load(2 * STALL_S), ray.exceptions.GetTimeoutError("no answer"), _load(2 * STALL_S)]
    started_s = time.monotonic()
    loss, _ = _elastic().rank_loss(_Ray, Instance("decode", 0, ranks), first)
    assert (loss.lost, loss.survivors) == ((1,), (0, 2)) and ranks[1].probes == 1
    assert STALL_S / 2 <= time.monotonic() - started_s < CALL_TIMEOUT_S


def test_a_re_probe_sent_earlier_is_awaited_only_for_what_is_left_of_its_wait() -> None:
    """The health monitor's re-probe, sent half the stall time before the round's first wait ended: a rank
    silent to it is lost at once; one that answers it meanwhile is not."""
    for delay_s, lost in ((None, (1,)), (STALL_S / 4, ())):
        ranks = [_Rank(_load(2 * STALL_S), 0.0), _Rank(_load(0.0), delay_s)]
        first = [_load(2 * STALL_S), ray.exceptions.GetTimeoutError("no answer")]
        sent = {1: (ranks[1].load.options().remote(), time.monotonic())}
        time.sleep(STALL_S / 2)
        started_s = time.monotonic()
        loss, _ = _elastic().rank_loss(_Ray, Instance("decode", 0, ranks), first, sent)
        assert (loss.lost if loss else ()) == lost and ranks[1].probes == 1
        assert time.monotonic() - started_s < STALL_S / 2  # (no fresh wait of its own)


def test_a_dead_rank_is_not_probed_again() -> None:
    ranks = [_Rank(_load(0.0), 0.0), _Rank(_load(0.0), 0.0)]
    loss, _ = _elastic().rank_loss(
        _Ray, Instance("decode", 0, ranks), [_load(0.0), ray.exceptions.ActorDiedError()]
    )
    assert loss.lost == (1,) and [r.probes for r in ranks] == [0, 0]


def test_a_refusal_is_told_by_its_type_through_ray_not_by_its_text() -> None:
    refused = PlacementRefused("2 surviving ranks x 4 expert slots cannot hold 9 logical experts")
    in_actor = ray.exceptions.RayTaskError("reform_group", "Traceback ...", refused)
    assert placement_refused(refused) and placement_refused(in_actor)
    assert placement_refused(in_actor.as_instanceof_cause())
    other = ray.exceptions.RayTaskError("reform_group", "Traceback ...", ValueError("PlacementRefused?"))
    assert not placement_refused(other) and not placement_refused(RuntimeError("PlacementRefused"))


@pytest.mark.parametrize(
    "bundles,num_ranks,survivors,want",
    [
        (None, 4, (1, 2, 3), 1),  # deployed bundles; rank 0 lost: old rank 1 leads on bundle 1
        ([0, 2, 3], 3, (1, 2), 2),  # shrunk before (bundle 1 gone); rank 0 lost again: bundle 2
        ([2, 3], 2, (0,), 2),  # growing back: rank 0 (bundle 2) stays the leader, not bundle 0
    ],
)
def test_the_rendezvous_is_on_the_new_groups_rank_0s_bundle(bundles, num_ranks, survivors, want) -> None:
    assert rendezvous_bundle(bundles, num_ranks, survivors) == want


def test_shrinking_runs_on_the_elastic_worker_and_the_monitor_round_goes_on() -> None:
    """The fault: a re-forming that hangs until released. `on_probe` hands it to the elastic worker and
    returns; while it runs the instance is neither detected again nor re-formed twice."""
    released, calls = threading.Event(), []
    elastic = _elastic()
    elastic._fail_attempts = lambda *a: calls.append(("fail", a))

    def shrink(ray, instance, loss, outcomes):  # (the re-forming, hanging)
        calls.append(("shrink", loss.lost))
        released.wait(CALL_TIMEOUT_S)

    elastic.shrink = shrink
    elastic.deployment.topology.kv_transport = "grpc"
    instance = Instance("decode", 0, [_Rank(_load(0.0), 0.0), _Rank(_load(0.0), None)])
    outcomes = [_load(0.0), ray.exceptions.ActorDiedError()]
    started_s = time.monotonic()
    assert elastic.on_probe(_Ray, instance, outcomes)
    assert elastic.busy(("decode", 0)) and not elastic.may_detect(instance)
    assert elastic.on_probe(_Ray, instance, outcomes)  # the next round: handled, not shrunk again
    assert time.monotonic() - started_s < CALL_TIMEOUT_S / 2
    released.set()
    assert elastic.wait_idle(CALL_TIMEOUT_S) and not elastic.busy(("decode", 0))
    assert [c for c in calls if c[0] == "shrink"] == [("shrink", (1,))]
    assert calls[0] == ("fail", ("decode", 0, {0: 0}))
    elastic.close()


def test_growth_failing_in_a_row_backs_off_then_stops_with_a_log_line(caplog) -> None:
    """A replacement that cannot be placed (the fault: each attempt fails): the next attempt waits
    `grow_after_s` doubled per failure; after MAX_GROW_TRIES in a row no more attempts, said once."""
    from pdcluster.driver.elastic_grow import MAX_GROW_TRIES

    elastic, key = _elastic(), ("decode", 0)
    elastic.grow_after_s = 10.0
    instance = Instance("decode", 0, [object()])
    for tries in range(1, MAX_GROW_TRIES):
        before_s = time.monotonic()
        elastic._missed(key, instance, "bundle(s) [1] are on no live node now")
        wait_s = elastic._changed_s[key] - before_s + elastic.grow_after_s
        assert wait_s == pytest.approx(2 ** (tries - 1) * elastic.grow_after_s, abs=0.5)  # (clock slack)
        assert key not in elastic._grow_given_up
    elastic._missed(key, instance, "bundle(s) [1] are on no live node now")
    assert key in elastic._grow_given_up
    assert f"growing back given up after {MAX_GROW_TRIES} tries in a row" in caplog.text
    assert "serves degraded on 1 rank(s)" in caplog.text
    elastic.close()
