"""RoPE (interleaved and half-split layouts, YaRN frequencies) and RMSNorm references."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.norm import rms_norm
from pdcluster.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from tests.conftest import hf_config_for, tiny_config

ROPE_DIM = 8


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Tests in this file that draw from torch's global generator draw the same numbers on every run."""
    torch.manual_seed(0)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """`(x0, x1, x2, x3, ...)` -> `(x0, x2, ..., x1, x3, ...)`: interleaved pairs to the half-split layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def tables(positions: torch.Tensor, yarn: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    config = tiny_config(yarn=yarn)
    return rope_cos_sin(positions, rope_inv_freq(config), config.rope_attention_factor)


def test_interleaved_is_half_split_on_deinterleaved_dims() -> None:
    """Rotating interleaved pairs equals rotating halves after moving even dims first and odd dims last."""
    x = torch.randn(6, 3, ROPE_DIM)  # [num_tokens, heads, rope_dim]
    cos, sin = tables(torch.tensor([0, 1, 5, 17, 100, 4000]), yarn=True)
    interleaved = apply_rope(x, cos, sin, interleave=True)
    half_split = apply_rope(deinterleave(x), cos, sin, interleave=False)
    assert torch.equal(deinterleave(interleaved), half_split)
    assert not torch.equal(interleaved, apply_rope(x, cos, sin, interleave=False))


@pytest.mark.parametrize("interleave", [True, False])
def test_rotation_properties(interleave) -> None:
    q, k = torch.randn(1, ROPE_DIM), torch.randn(1, ROPE_DIM)
    inv_freq = rope_inv_freq(tiny_config())

    def rot(x: torch.Tensor, pos: int) -> torch.Tensor:
        cos, sin = rope_cos_sin(torch.tensor([pos]), inv_freq)
        return apply_rope(x, cos, sin, interleave)

    assert torch.equal(rot(q, 0), q)  # position 0 is the identity
    torch.testing.assert_close(rot(q, 37).norm(), q.norm())  # a rotation keeps the norm
    # q.k after rotation depends only on the distance between positions
    dots = [(rot(q, m) * rot(k, n)).sum() for m, n in ((3, 1), (10, 8), (102, 100))]
    torch.testing.assert_close(dots[0], dots[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dots[0], dots[2], rtol=1e-5, atol=1e-5)


def test_apply_rope_explicit_values_and_dtype() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cos, sin = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])  # pair 0 turns 90 degrees, pair 1 stays
    assert apply_rope(x, cos, sin, interleave=True).tolist() == [[-2.0, 1.0, 3.0, 4.0]]
    assert apply_rope(x, cos, sin, interleave=False).tolist() == [[-3.0, 2.0, 1.0, 4.0]]
    out = apply_rope(x.to(torch.bfloat16)[:, None, :].expand(1, 2, 4), cos, sin)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 2, 4)


def test_yarn_frequencies_keep_fast_dims_and_stretch_slow_ones() -> None:
    plain = rope_inv_freq(tiny_config())
    torch.testing.assert_close(plain, 10000.0 ** (-torch.arange(0, ROPE_DIM, 2) / ROPE_DIM))
    yarn = rope_inv_freq(tiny_config(yarn=True))
    assert yarn[0] == plain[0]  # rotates more than beta_fast times over the original context: kept
    torch.testing.assert_close(yarn[2:], plain[2:] / 4.0)  # fewer than beta_slow times: divided by factor
    assert plain[1] / 4.0 < yarn[1] < plain[1]  # on the ramp: blended


@pytest.mark.parametrize("yarn", [False, True], ids=["default", "yarn"])
def test_rope_tables_and_softmax_scale_match_transformers(yarn) -> None:
    """transformers' DeepSeek-V3 rotary embedding and attention scale are an independent oracle."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        yarn_apply_mscale,
    )

    config = tiny_config(yarn=yarn)
    hf_config = hf_config_for(config)
    hf_rope = DeepseekV3RotaryEmbedding(hf_config)
    torch.testing.assert_close(rope_inv_freq(config), hf_rope.inv_freq, rtol=1e-6, atol=0)
    assert config.rope_attention_factor == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    assert config.softmax_scale == pytest.approx(
        yarn_apply_mscale(hf_config.rope_parameters, config.qk_head_dim**-0.5), rel=1e-12
    )

    positions = torch.tensor([0, 1, 63, 64, 255])
    hf_cos, hf_sin = hf_rope(torch.zeros(1, 5, 1), positions[None])  # [1, S, rope_dim]: (freqs, freqs)
    cos, sin = tables(positions, yarn=yarn)
    torch.testing.assert_close(cos, hf_cos[0, :, : ROPE_DIM // 2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0, :, : ROPE_DIM // 2], rtol=1e-5, atol=1e-6)


def test_rms_norm() -> None:
    x = torch.randn(3, 5, 16) * 7
    weight = torch.randn(16)
    want = weight.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), want.float(), rtol=1e-5, atol=1e-6)
    out = rms_norm(x.to(torch.bfloat16), weight.to(torch.bfloat16), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=0.02, atol=0.02)
