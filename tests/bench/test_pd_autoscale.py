"""bench.pd_autoscale's setup: the prefill step budget sized to the TTFT SLO."""

from __future__ import annotations

import dataclasses

import pytest

from bench.pd_autoscale import cluster_topology, prefill_budget_within_slo


class _LinearPrefill:
    """A step of n prompt tokens takes 0.1 s + 10 us per token (any chunking)."""

    def step_time_s(self, shape) -> float:  # noqa: ANN001
        return 0.1 + 1e-5 * sum(c.num_tokens for c in shape.prefill)


def test_the_budget_is_cut_to_a_step_of_half_the_ttft_slo_and_kept_when_it_fits():
    topo = cluster_topology("cm384")  # TTFT SLO 2 s: a step of at most 1 s, 90,000 tokens here
    cut = prefill_budget_within_slo(topo, _LinearPrefill())
    assert cut.prefill.max_num_batched_tokens == 87 * 1024  # the largest multiple of 1024 within 1 s
    small = dataclasses.replace(topo, prefill=dataclasses.replace(topo.prefill, max_num_batched_tokens=4096))
    assert prefill_budget_within_slo(small, _LinearPrefill()) is small
    slow = dataclasses.replace(topo, slo=dataclasses.replace(topo.slo, ttft_ms=100.0))
    with pytest.raises(SystemExit, match="no prefill step of 1024 tokens fits half the TTFT SLO"):
        prefill_budget_within_slo(slow, _LinearPrefill())
