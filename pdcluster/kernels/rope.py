"""Rotary position embedding (Su et al., RoFormer, 2021) with YaRN scaling (Peng et al., 2023).

Applied only to the decoupled `qk_rope_head_dim` part (DeepSeek-V2 section 2.1.3); the public checkpoints
interleave pairs `(x0, x1), (x2, x3), ...` (`rope_interleave: true`).
"""

from __future__ import annotations

import math

import torch

from pdcluster.models.config import DeepseekV3Config


def rope_inv_freq(config: DeepseekV3Config) -> torch.Tensor:
    """Inverse frequencies [qk_rope_head_dim // 2] float32, YaRN "NTK-by-parts" (section 3.2) when scaled."""
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
    """positions: [num_tokens] int64; inv_freq: [d // 2] -> cos, sin: [num_tokens, d // 2] float32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True
) -> torch.Tensor:
    """Rotate the rope dimensions of x: [num_tokens, ..., rope_dim]; cos, sin: [num_tokens, rope_dim // 2].

    interleave: pairs `(x[2i], x[2i+1])` (DeepSeek layout) or `(x[i], x[i + d/2])`.
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
