from __future__ import annotations

import dataclasses

import pytest

from pdcluster.engine.sampling_params import SamplingParams


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
        # Issue 12, finding 2: values that passed validation and then broke the sampler's whole step.
        (
            dict(seed=2**70),
            r"seed must be in \[0, 2\*\*64\) \(a torch.Generator seed\), got 1180591620717411303424",
        ),
        (
            dict(seed=2**64),
            r"seed must be in \[0, 2\*\*64\) \(a torch.Generator seed\), got 18446744073709551616",
        ),
        (dict(seed=-1), r"seed must be in \[0, 2\*\*64\) \(a torch.Generator seed\), got -1"),
        (dict(top_p=1e-300), r"top_p must be > 0 in float32 \(the sampler's precision\), got 1e-300"),
        (dict(temperature=1e-300), r"temperature must be 0 \(greedy\) or >= 1e-05: .*, got 1e-300"),
        (dict(temperature=1e-40), r"temperature must be 0 \(greedy\) or >= 1e-05: .*, got 1e-40"),
        (dict(top_k=2**63), r"top_k must be <= 2\*\*63 - 1 \(int64\), got 9223372036854775808"),
    ],
)
def test_invalid_values_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SamplingParams(**kwargs)


def test_edge_values_are_valid():
    SamplingParams(temperature=0, top_p=1, top_k=-1, seed=0, max_tokens=1, logprobs=0)
    SamplingParams(temperature=1e-5, top_p=1.5e-45, top_k=2**63 - 1, seed=2**64 - 1)
    SamplingParams(temperature=1e300)  # no upper bound: uniform over what top-k / top-p keep


def test_values_that_pass_validation_sample_without_error():
    """The edges validation lets through are ones the sampler (and torch.Generator) take: finite
    probabilities that sum to 1, a seeded generator, top_k as int64."""
    import torch

    from pdcluster.kernels.sampling import probs_from_logits, sample

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 30
    edges = [
        SamplingParams(temperature=1e-5, top_p=1.5e-45),
        SamplingParams(temperature=1e300, top_k=2**63 - 1),
        SamplingParams(temperature=1.0, top_p=1e-45, top_k=2),
        SamplingParams(temperature=0.7, seed=2**64 - 1),
    ]
    temperature = torch.tensor([p.temperature for p in edges])
    top_k = torch.tensor([p.top_k for p in edges])
    top_p = torch.tensor([p.top_p for p in edges])
    probs = probs_from_logits(logits, temperature, top_k, top_p)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))
    generators = [torch.Generator().manual_seed(p.seed if p.seed is not None else 1) for p in edges]
    assert sample(logits, temperature, top_k, top_p, generators).shape == (4,)
