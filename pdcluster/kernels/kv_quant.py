"""INT8 latent KV quantization: one symmetric scale per token, and KV cache byte sizes."""

from __future__ import annotations

import torch

INT8_MAX = 127  # symmetric range [-127, 127]; -128 is never produced


def quantize_kv_int8(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize latent KV rows to int8 with a per-row absmax scale.
    latent: `[num_tokens, kv_dim]` float (float32, bf16 or fp16), `kv_dim = kv_lora_rank + qk_rope_head_dim`.
    Returns `(latent_int8 [num_tokens, kv_dim] int8, scale [num_tokens] float32)` with
    `scale = max|latent| / 127` per row; an all-zero row gets scale 0 and int8 zeros.
    The round-trip error per element is at most `scale / 2`.
    Raises ValueError: `latent` is not 2-D or not a floating-point tensor.
    """
    if latent.dim() != 2 or not latent.is_floating_point():
        raise ValueError(f"latent must be a 2-D float tensor, got {tuple(latent.shape)} {latent.dtype}")
    latent = latent.float()
    scale = latent.abs().amax(dim=-1) / INT8_MAX  # [num_tokens] float32
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    latent_int8 = (latent / safe_scale[:, None]).round().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return latent_int8, scale


def dequantize_kv_int8(
    latent_int8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Reference dequantization `latent_int8 * scale`.

    latent_int8: `[..., kv_dim]` int8.
    scale: `[...]` float32, one scale per token (the leading shape of `latent_int8`).
    Returns `[..., kv_dim]` in `dtype`.
    Raises ValueError: dtype or shape mismatch.
    """
    if latent_int8.dtype != torch.int8:
        raise ValueError(f"latent_int8 must be int8, got {latent_int8.dtype}")
    if scale.shape != latent_int8.shape[:-1]:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} != latent shape[:-1] {tuple(latent_int8.shape[:-1])}"
        )
    return (latent_int8.float() * scale.float()[..., None]).to(dtype)


def kv_cache_bytes_per_token(kv_dim: int, dtype: torch.dtype, num_layers: int) -> int:
    """Bytes of latent KV cache one token occupies over `num_layers` layers.

    dtype: cache element dtype (`torch.float32`, `torch.bfloat16`, `torch.float16` or `torch.int8`).
    Raises ValueError: non-positive sizes or an integer dtype other than int8.
    """
    if kv_dim <= 0 or num_layers <= 0:
        raise ValueError(f"kv_dim and num_layers must be positive, got {kv_dim}, {num_layers}")
    if dtype == torch.int8:
        per_layer_bytes = kv_dim * torch.int8.itemsize + torch.float32.itemsize  # values + one scale
    elif dtype.is_floating_point:
        per_layer_bytes = kv_dim * dtype.itemsize
    else:
        raise ValueError(f"unsupported KV cache dtype {dtype}")
    return per_layer_bytes * num_layers
