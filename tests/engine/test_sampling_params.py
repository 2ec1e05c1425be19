from __future__ import annotations

import dataclasses

import pytest

from engine.sampling_params import SamplingParams


def test_defaults_and_derived_flags():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)
    assert not params.is_greedy and not params.top_k_enabled
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=5).top_k_enabled and not SamplingParams(top_k=-1).top_k_enabled


def test_sequences_are_frozen_into_tuples():
    params = SamplingParams(stop_token_ids=[3, 4], stop="END")
    assert params.stop_token_ids == (3, 4) and params.stop == ("END",)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(3, 4), stop=("END",)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-2), "top_k must be an int >= 1, or 0 / -1 to disable it, got -2"),
        (dict(seed=1.5), "seed must be None or an int, got 1.5"),
        (dict(max_tokens=0), "max_tokens must be an int >= 1, got 0"),
        (dict(max_tokens=True), "max_tokens must be an int >= 1, got True"),
        (dict(stop_token_ids=[1, -1]), r"stop_token_ids must be ints >= 0, got \[1, -1\]"),
        (dict(stop=["ok", ""]), r"stop must be non-empty strings, got \['ok', ''\]"),
        (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
        (dict(logprobs=-1), "logprobs must be None or an int >= 0, got -1"),
    ],
)
def test_invalid_values_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SamplingParams(**kwargs)


def test_edge_values_are_valid():
    SamplingParams(temperature=0, top_p=1, top_k=-1, seed=0, max_tokens=1, logprobs=0)
