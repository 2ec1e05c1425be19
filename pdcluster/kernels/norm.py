"""RMSNorm reference (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x**2) + eps)` in float32; x: [..., dim], weight: [dim]."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
