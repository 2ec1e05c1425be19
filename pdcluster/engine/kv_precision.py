"""KV cache precision by sequence length: a pure policy that picks each request's KV dtype at admission.

and float32 in the first layer for long sequences). Bands whose per-layer dtypes are equal share one
Names: `auto` (the model dtype), `int8` (per-token scales, `kernels.kv_quant`), `bfloat16`, `float16`,
`float32`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.kernels.kv_quant import kv_cache_bytes_per_token

KV_DTYPE_NAMES = ("auto", "int8", "bfloat16", "float16", "float32")
_TORCH_DTYPES = {
    "int8": torch.int8,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# One pool's cache dtype per layer (main layers then MTP layers).
LayerDtypes = tuple[torch.dtype, ...]


def kv_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype a name stands for (`auto`: `model_dtype`)."""
    if name == "auto":
        return model_dtype
    if name not in _TORCH_DTYPES:
        raise ValueError(f"KV dtype must be one of {KV_DTYPE_NAMES}, got {name!r}")
    return _TORCH_DTYPES[name]


def parse_layer_range(text: str) -> tuple[int, int]:
    """`"a-b"` or `"a"` -> `(a, b)` inclusive layer indices."""
    parts = text.split("-")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"layer range must look like '0-3' or '2', got {text!r}")
    first, last = int(parts[0]), int(parts[-1])
    if last < first:
        raise ValueError(f"layer range {text!r}: last layer before first")
    return first, last


@dataclass(frozen=True)
class KVBand:
    """One length band."""

    max_tokens: int | None
    dtype: str
    key_layers: tuple[int, int] | None = None
    key_layers_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"band max_tokens must be >= 1, got {self.max_tokens}")
        for name in (self.dtype, self.key_layers_dtype):
            if name is not None and name not in KV_DTYPE_NAMES:
                raise ValueError(f"band dtype must be one of {KV_DTYPE_NAMES}, got {name!r}")
        if (self.key_layers is None) != (self.key_layers_dtype is None):
            raise ValueError("key_layers and key_layers_dtype go together")

    def layer_dtype_names(self, num_layers: int, model_dtype: str) -> list[str]:
        """Cache dtype name of each of `num_layers` layers (`auto` resolved to `model_dtype`)."""
        names = [self.dtype] * num_layers
        if self.key_layers is not None and self.key_layers_dtype is not None:
            first, last = self.key_layers
            names[first : min(last, num_layers - 1) + 1] = [self.key_layers_dtype] * (
                min(last, num_layers - 1) + 1 - first
            )
        return [model_dtype if n == "auto" else n for n in names]

    def layer_dtypes(self, num_layers: int, model_dtype: torch.dtype) -> LayerDtypes:
        """Cache dtype of each of `num_layers` layers."""
        names = self.layer_dtype_names(num_layers, "auto")
        return tuple(kv_torch_dtype(n, model_dtype) for n in names)

    def describe(self) -> str:
        text = self.dtype
        if self.key_layers is not None:
            text += f" ({self.key_layers_dtype} in layers {self.key_layers[0]}-{self.key_layers[1]})"
        return text


@dataclass(frozen=True)
class KVPrecisionPolicy:
    """Length bands, shortest first; the last has `max_tokens` None.
    Raises ValueError: no bands, bounds not increasing, or a bounded last band."""

    bands: tuple[KVBand, ...]

    def __post_init__(self) -> None:
        if not self.bands:
            raise ValueError("a KV precision policy needs at least one band")
        bounds = [b.max_tokens for b in self.bands]
        if bounds[-1] is not None or any(b is None for b in bounds[:-1]):
            raise ValueError("only the last band is unbounded (max_tokens null), and it must be")
        if any(a >= b for a, b in zip(bounds[:-2], bounds[1:-1], strict=False)):
            raise ValueError(f"band max_tokens must increase, got {bounds}")

    @classmethod
    def single(cls, dtype: str) -> KVPrecisionPolicy:
        """One band: every request in `dtype` (what a pool's `kv_cache_dtype` means)."""
        return cls((KVBand(None, dtype),))

    def band_index(self, num_tokens: int) -> int:
        """Index of the band an admission length of `num_tokens` (prompt + max_tokens) falls in."""
        for i, band in enumerate(self.bands):
            if band.max_tokens is None or num_tokens <= band.max_tokens:
                return i
        raise AssertionError("unreachable: the last band is unbounded")

    def pools(self, num_layers: int, model_dtype: torch.dtype) -> tuple[list[LayerDtypes], list[int]]:
        """Distinct per-layer dtype tuples (one block pool each, in band order) and each band's pool."""
        pools: list[LayerDtypes] = []
        band_to_pool: list[int] = []
        for band in self.bands:
            dtypes = band.layer_dtypes(num_layers, model_dtype)
            if dtypes not in pools:
                pools.append(dtypes)
            band_to_pool.append(pools.index(dtypes))
        return pools, band_to_pool

    def bytes_per_token(self, band: int, kv_dim: int, num_layers: int, model_dtype: torch.dtype) -> int:
        """KV cache bytes one token of a request in `band` occupies over all `num_layers` layers."""
        dtypes = self.bands[band].layer_dtypes(num_layers, model_dtype)
        return sum(kv_cache_bytes_per_token(kv_dim, d, 1) for d in dtypes)


def request_kv_cache_dtype(
    policy: KVPrecisionPolicy | None, default: str, num_prompt_tokens: int, max_tokens: int
) -> str:
    """A request's `kv_cache_dtype` for its P->D handoff (`kvtransfer.base.resolve_wire_dtype`): `int8` when
    its band stores int8 (its KV then crosses the wire as int8), else `auto`; `default` (the pool's
    `kv_cache_dtype`) without a policy.
    """
    if policy is None:
        return default
    band = policy.bands[policy.band_index(admission_length(num_prompt_tokens, max_tokens))]
    return "int8" if band.dtype == "int8" else "auto"


def admission_length(num_prompt_tokens: int, max_tokens: int) -> int:
    """The length a request is banded by: the most tokens it can hold (prompt + max_tokens)."""
    return num_prompt_tokens + max_tokens
