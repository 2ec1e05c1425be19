"""Rotary position embedding (Su et al., RoFormer, 2021) with YaRN scaling (Peng et al., 2023).

DeepSeek-V3 applies RoPE only to the decoupled `qk_rope_head_dim` part of queries and keys (DeepSeek-V2
paper, section 2.1.3). The public checkpoints store those dimensions as interleaved pairs
`(x0, x1), (x2, x3), ...` (`rope_interleave: true`); `rope_interleave: false` rotates halves instead.
"""

from __future__ import annotations

import math

import torch

from pdcluster.models.config import DeepseekV3Config


def rope_inv_freq(config: DeepseekV3Config) -> torch.Tensor:
    """Inverse frequencies `[qk_rope_head_dim // 2]` float32, YaRN-blended when `rope_scaling` is set.

    YaRN (paper section 3.2, "NTK-by-parts"): dimensions that rotate more than `beta_fast` times over the
    original context keep their frequency, those rotating fewer than `beta_slow` times are divided by
    `factor`, and a linear ramp blends the ones between.
    """
    dim = config.qk_rope_head_dim
    base = config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    rs = config.rope_scaling
    if rs is None:
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return inv_freq / rs.factor * (1 - extrapolation_weight) + inv_freq * extrapolation_weight


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions.

    Args:
        positions: `[num_tokens]` int64 absolute positions.
        inv_freq: `[rope_dim // 2]` float32 from `rope_inv_freq`.
        attention_factor: YaRN multiplier on cos/sin (`DeepseekV3Config.rope_attention_factor`).

    Returns:
        `(cos, sin)`, each `[num_tokens, rope_dim // 2]` float32.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True
) -> torch.Tensor:
    """Rotate the rope dimensions of `x`.

    Args:
        x: `[num_tokens, ..., rope_dim]` (heads, if any, between tokens and rope_dim).
        cos, sin: `[num_tokens, rope_dim // 2]` from `rope_cos_sin`.
        interleave: pairs are `(x[2i], x[2i+1])` when True (DeepSeek layout), `(x[i], x[i + d/2])` when False.

    Returns:
        Same shape and dtype as `x`. With `interleave=True` the output keeps the interleaved layout.
    """
    dtype = x.dtype
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(dtype)
