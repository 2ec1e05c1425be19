from __future__ import annotations

import pytest

from pdcluster.engine.request import DraftCounts, Request, RequestStatus


def test_token_accounting(make_request):
    request = make_request(prompt=[1, 2, 3], max_tokens=5)
    assert (request.num_prompt_tokens, request.num_tokens, request.max_num_tokens) == (3, 3, 8)
    assert request.num_tokens_to_compute == 3
    request.num_computed_tokens = 3
    request.append_output_token_ids([9])
    request.spec_token_ids = [4, 5]
    assert request.all_token_ids == [1, 2, 3, 9] and request.output_token_ids == [9]
    assert (request.num_tokens, request.num_tokens_with_spec, request.num_tokens_to_compute) == (4, 6, 3)


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="prompt_token_ids of request 'x' is empty"):
        Request("x", [])


def test_draft_counts_per_position():
    drafts = DraftCounts()
    assert drafts.acceptance_rate is None
    drafts = drafts.plus(3, 2).plus(2, 0).plus(4, 4)
    assert (drafts.num_draft_tokens, drafts.num_accepted_tokens) == (9, 6)
    assert drafts.num_draft_tokens_per_position == (3, 3, 2, 1)
    assert drafts.num_accepted_tokens_per_position == (2, 2, 1, 1)
    drafts = drafts.plus(5, 0)
    assert drafts.num_draft_tokens_per_position == (4, 4, 3, 2, 1)
    assert drafts.num_accepted_tokens_per_position == (2, 2, 1, 1, 0)
    assert drafts.acceptance_rate == 6 / 14
    with pytest.raises(ValueError, match=r"num_accepted_tokens must be in \[0, 2\], got 3"):
        drafts.plus(2, 3)


def test_phase_times(make_request):
    request = make_request()
    assert (request.queue_time_s, request.ttft_s, request.tpot_s) == (None, None, None)
    request.arrival_time_s, request.first_scheduled_time_s = 1.0, 1.5
    request.first_token_time_s, request.last_token_time_s = 2.0, 3.0
    request.append_output_token_ids([5, 6, 7])
    assert (request.queue_time_s, request.ttft_s, request.tpot_s) == (0.5, 1.0, 0.5)


def test_status_finish_reasons():
    reasons = [None, None, None, None, "stop", "length", "abort", "error"]
    assert [s.finish_reason for s in RequestStatus] == reasons
    assert [s.is_finished for s in RequestStatus] == [False] * 4 + [True] * 4
