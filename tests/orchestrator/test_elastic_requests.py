"""A prefill instance of several ranks that lost one (`driver.elastic_requests.reforming`): its in-flight
prefills are re-dispatched with the instance not excluded, though no other prefill instance is live."""

from __future__ import annotations

from types import SimpleNamespace

from pdcluster.driver.dispatch import AttemptState, Fail, PrefillFailed, Redispatch, next_action
from pdcluster.driver.elastic_requests import GROUP_FAILED, reforming

ONLY_PREFILL = AttemptState(
    "r1", attempt_index=0, prefill_instance=0, decode_instance=0, num_other_prefills=0, event_timeout_s=35.0
)


def test_a_prefill_failed_with_its_re_forming_group_is_re_dispatched_to_any_prefill_instance() -> None:
    action = next_action(ONLY_PREFILL, PrefillFailed(f"{GROUP_FAILED}: gloo closed", reforming=True))
    assert isinstance(action, Redispatch) and action.excluded_prefill is None
    assert action.error.endswith("re-dispatched, its instance re-forming on its other ranks"), action.error
    assert "prefill-0: instance group failed: gloo closed" in action.error
    # without re-forming, no other prefill instance: the request fails, as before
    assert isinstance(next_action(ONLY_PREFILL, PrefillFailed("died")), Fail)
    # the last attempt fails either way
    last = AttemptState("r1", attempt_index=1, prefill_instance=0, decode_instance=0, num_other_prefills=0)
    assert isinstance(next_action(last, PrefillFailed(GROUP_FAILED, reforming=True)), Fail)


def test_only_an_elastic_multi_rank_instance_that_may_recover_re_forms() -> None:
    def instance(num_ranks: int, may_recover: bool = True) -> SimpleNamespace:
        return SimpleNamespace(num_ranks=num_ranks, may_recover=may_recover)

    message = f"engine step failed: {GROUP_FAILED}: EPCollectiveError"
    assert reforming(instance(2), True, message) and reforming(instance(2), True)  # (a lost rank)
    assert not reforming(instance(2), False, message)  # elastic_ep off (or torch_distributed KV)
    assert not reforming(instance(1), True, message)
    assert not reforming(instance(2, may_recover=False), True, message)  # given up on
    assert not reforming(instance(2), True, "prefill failed: bad logits")  # one request's fault
