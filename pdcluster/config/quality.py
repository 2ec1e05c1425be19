"""Topology sections for output quality: `kv_precision` (KV dtype by request length) and `accuracy` (the gate
`pdcluster accuracy` checks before a configuration serves).

short:  {max_tokens: 256, kv_cache_dtype: int8}
medium: {max_tokens: 768, kv_cache_dtype: bfloat16}
long:   {kv_cache_dtype: bfloat16, key_layers: "0-0", key_layers_dtype: float32}
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pdcluster.config.fields import (
    MAX_TOKENS,
    above_at_most,
    at_least,
    between,
    check_fields,
    choices,
)
from pdcluster.config.issues import Issue
from pdcluster.engine.kv_precision import KV_DTYPE_NAMES, KVBand, KVPrecisionPolicy, parse_layer_range

BAND_NAMES = ("short", "medium", "long")


def _layer_range_problem(text: str) -> str | None:
    try:
        parse_layer_range(text)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class KVBandConfig:
    """One band: `max_tokens` (inclusive bound on prompt + max_tokens; null only on `long`), its
    `kv_cache_dtype`, and optionally `key_layers` (`"first-last"`, inclusive) stored in `key_layers_dtype`.
    """

    max_tokens: int | None = field(default=None, metadata=between(1, MAX_TOKENS))
    kv_cache_dtype: str = field(default="auto", metadata=choices(*KV_DTYPE_NAMES))
    key_layers: str | None = field(default=None, metadata={"check": _layer_range_problem})
    key_layers_dtype: str | None = field(default=None, metadata=choices(*KV_DTYPE_NAMES))

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.key_layers is None) != (self.key_layers_dtype is None):
            raise ValueError("KVBandConfig fields 'key_layers' and 'key_layers_dtype': set both or neither")

    def band(self, max_tokens: int | None) -> KVBand:
        layers = None if self.key_layers is None else parse_layer_range(self.key_layers)
        return KVBand(max_tokens, self.kv_cache_dtype, layers, self.key_layers_dtype)


@dataclass(frozen=True)
class KVPrecisionConfig:
    """Length bands `short` < `medium` < `long` (the first two optional); `long` takes the longer rest."""

    short: KVBandConfig | None = None
    medium: KVBandConfig | None = None
    long: KVBandConfig = field(default_factory=KVBandConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        bounds = [b.max_tokens for b in (self.short, self.medium) if b is not None]
        if any(b is None for b in bounds):
            raise ValueError("KVPrecisionConfig: short and medium need max_tokens")
        if self.long.max_tokens is not None:
            raise ValueError("KVPrecisionConfig field 'long': max_tokens must be null (it has no bound)")
        if bounds != sorted(set(bounds)):
            raise ValueError(f"KVPrecisionConfig: band max_tokens must increase, got {bounds}")

    def named_bands(self) -> list[tuple[str, KVBandConfig]]:
        return [(n, b) for n, b in zip(BAND_NAMES, (self.short, self.medium, self.long), strict=True) if b]

    def policy(self) -> KVPrecisionPolicy:
        return KVPrecisionPolicy(tuple(b.band(b.max_tokens) for _, b in self.named_bands()))


@dataclass(frozen=True)
class AccuracyConfig:
    """What `pdcluster accuracy` measures and the gate it applies (a null threshold is not checked)."""

    num_prompts: int = field(default=8, metadata=between(1, 256))
    num_generations: int = field(default=4, metadata=between(1, 256))
    band_lengths: str | None = None
    min_top1_agreement: float | None = field(default=0.95, metadata=between(0, 1))
    max_mean_kl: float | None = field(default=0.05, metadata=at_least(0))
    max_mtp_acceptance_drop: float | None = field(default=0.05, metadata=above_at_most(-1, 1))
    max_repetition_rate_increase: float | None = field(default=0.05, metadata=above_at_most(-1, 1))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.band_lengths is not None:
            parts = self.band_lengths.split(",")
            if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
                raise ValueError(
                    f"AccuracyConfig field 'band_lengths': three positive integers 'a,b,c', "
                    f"got {self.band_lengths!r}"
                )


def quality_issues(sections: dict, num_layers: int | None) -> Iterator[Issue]:
    """Cross-section rules: a `kv_precision` policy leaves the pools' `kv_cache_dtype` at auto, and its key
    layers exist in the model (`num_layers`: main + MTP layers, None when the model is unknown).
    """
    kvp: KVPrecisionConfig | None = sections.get("kv_precision")
    if kvp is None:
        return
    for role in ("prefill", "decode"):
        pool = sections.get(role)
        if pool is not None and pool.kv_cache_dtype != "auto":
            yield Issue(
                (role, "kv_cache_dtype"),
                f"{role}.kv_cache_dtype: {pool.kv_cache_dtype!r} conflicts with kv_precision (leave it auto)",
            )
    if num_layers is None:
        return
    for name, band in kvp.named_bands():
        if band.key_layers is not None and parse_layer_range(band.key_layers)[1] >= num_layers:
            yield Issue(
                ("kv_precision", name, "key_layers"),
                f"kv_precision.{name}.key_layers: {band.key_layers!r} past the model's {num_layers} layers",
            )
