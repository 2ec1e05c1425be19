"""INT8 per-token KV quantization and KV cache byte sizes."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.kv_quant import dequantize_kv_int8, kv_cache_bytes_per_token, quantize_kv_int8


def test_round_trip_error_is_at_most_half_a_step() -> None:
    latent = (
        torch.randn(16, 20, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 16)[:, None]
    )
    latent_int8, scale = quantize_kv_int8(latent)
    assert latent_int8.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (16,)
    assert latent_int8.abs().max() == 127 and latent_int8.min() >= -127
    torch.testing.assert_close(scale, latent.abs().amax(-1) / 127)
    error = (dequantize_kv_int8(latent_int8, scale) - latent).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-5)).all())


def test_zero_row_and_bf16_input() -> None:
    latent = torch.zeros(2, 8, dtype=torch.bfloat16)
    latent[1, 3] = -2.0
    latent_int8, scale = quantize_kv_int8(latent)
    assert (
        torch.equal(scale, torch.tensor([0.0, 2.0]) / 127)
        and latent_int8[1, 3] == -127
        and latent_int8[0].abs().sum() == 0
    )
    assert dequantize_kv_int8(latent_int8, scale, torch.bfloat16).dtype == torch.bfloat16


def test_bytes_per_token_from_itemsize() -> None:
    kv_dim = 512 + 64  # DeepSeek-V3
    assert kv_cache_bytes_per_token(kv_dim, torch.float32, 1) == 2304
    assert kv_cache_bytes_per_token(kv_dim, torch.bfloat16, 1) == 1152
    assert kv_cache_bytes_per_token(kv_dim, torch.int8, 1) == 576 + 4
    assert kv_cache_bytes_per_token(kv_dim, torch.int8, 61) == 61 * 580
    with pytest.raises(ValueError):
        kv_cache_bytes_per_token(kv_dim, torch.int32, 1)
    with pytest.raises(ValueError):
        quantize_kv_int8(torch.zeros(3, dtype=torch.float32))
