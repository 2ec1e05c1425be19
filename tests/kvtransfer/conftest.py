"""Factories for KV-transfer tests: handoffs, deterministic per-layer latents, extras, fault hooks.

Shapes are the tiny test model's (`tests.conftest.TINY_CONFIG`: kv_lora_rank 16 + qk_rope_head_dim 8 = 24,
2 layers + 1 MTP layer) unless a test needs more layers (the 5-layer handoff) or a layer large
enough to be split into several gRPC chunks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.kvtransfer.base import HandoffExtras, HandoffMeta, ReceivedLayer
from pdcluster.kvtransfer.wire import LayerHeader

TINY_KV_DIM = 16 + 8  # kv_lora_rank + qk_rope_head_dim of tests.conftest.TINY_CONFIG


def make_handoff(request_id: str = "req-0", **overrides) -> HandoffMeta:
    """A 5-layer handoff of 37 tokens (odd on purpose) in bfloat16, 10 s lease."""
    fields = dict(num_layers=5, num_tokens=37, kv_dim=TINY_KV_DIM, dtype="bfloat16", wire_dtype="bfloat16")
    fields["lease_s"] = 10.0
    fields.update(overrides)
    return HandoffMeta(request_id=request_id, **fields)


def make_layers(meta: HandoffMeta, seed: int = 0) -> list[torch.Tensor]:
    """`num_layers` latents `[num_tokens, kv_dim]` in the model dtype, with rows of very different scales."""
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-2, 2, meta.num_tokens)[:, None]
    return [
        (torch.randn(meta.num_tokens, meta.kv_dim, generator=gen) * row_scale).to(meta.torch_dtype)
        for _ in range(meta.num_layers)
    ]


def make_extras(meta: HandoffMeta, seed: int = 0, with_probs: bool = False) -> HandoffExtras:
    gen = torch.Generator().manual_seed(seed + 1)
    return HandoffExtras(
        first_token_id=7,
        draft_token_ids=[11, 3],
        draft_probs=torch.softmax(torch.randn(2, 64, generator=gen), dim=-1) if with_probs else None,
        # a sampled request's extras also carry its first token's logprobs
        first_token_logprobs=TokenLogprobs(7, -0.75, 2, [3, 7], [-0.5, -0.75]) if with_probs else None,
    )


def assert_extras_equal(got: HandoffExtras, want: HandoffExtras) -> None:
    assert got.first_token_id == want.first_token_id
    assert got.draft_token_ids == want.draft_token_ids
    assert got.first_token_logprobs == want.first_token_logprobs
    if want.draft_probs is None:
        assert got.draft_probs is None
    else:
        assert torch.equal(got.draft_probs, want.draft_probs)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe): same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def flip_byte_in_layer(layer_idx: int, byte_offset: int = 5):
    """A fault hook that flips one byte of the given layer's payload."""

    def hook(header: LayerHeader, payload: bytearray) -> bool:
        if header.layer_idx == layer_idx:
            payload[byte_offset] ^= 0xFF
        return True

    return hook


def stall_after(num_layers_sent: int):
    """A fault hook under which the sender sends `num_layers_sent` layers, then nothing more (stays open)."""
    sent: list[int] = []

    def hook(header: LayerHeader, payload: bytearray) -> bool:
        if len(sent) >= num_layers_sent:
            return False
        sent.append(header.layer_idx)
        return True

    return hook


@dataclass
class GatedCallback:
    """An `on_layer` callback that records layers but blocks on `gate` until the test opens it: a slow
    decode side. `entered` is set when the first call starts blocking."""

    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    layers: dict[int, ReceivedLayer] = field(default_factory=dict)

    def __call__(self, layer_idx: int, layer: ReceivedLayer) -> None:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        self.layers[layer_idx] = ReceivedLayer(
            layer.latent.clone(), None if layer.scale is None else layer.scale.clone()
        )


class PagedWriter:
    """Decode's `on_layer` as `DecodeWorker` registers it (`on_layer_checksums=True`): each layer is written
    into its own paged cache (4-token blocks, the table in a shuffled order) by
    `kernels.paged_mla.write_prompt_kv`, which returns the CRC-32C of an unverified layer's bytes as it
    copies them. `verified` records what each call was told; `layers()` reads the caches back."""

    BLOCK_SIZE = 4

    def __init__(self, meta: HandoffMeta) -> None:
        num_blocks = -(-meta.num_tokens // self.BLOCK_SIZE)
        self.num_tokens = meta.num_tokens
        self.caches = [
            torch.zeros(num_blocks + 2, self.BLOCK_SIZE, meta.kv_dim, dtype=meta.torch_dtype)
            for _ in range(meta.num_layers)
        ]
        self.block_table = torch.randperm(num_blocks + 2, generator=torch.Generator().manual_seed(3))
        self.verified: dict[int, bool] = {}

    def __call__(self, layer_idx: int, layer: ReceivedLayer) -> int | None:
        from pdcluster.kernels.paged_mla import write_prompt_kv

        self.verified[layer_idx] = layer.verified
        checksum_start = None if layer.verified else 0
        return write_prompt_kv(
            self.caches[layer_idx], layer.latent, self.block_table, None, None, checksum_start
        )

    def layers(self) -> list[ReceivedLayer]:
        from pdcluster.kernels.paged_mla import gather_kv

        return [
            ReceivedLayer(gather_kv(cache, self.block_table, self.num_tokens)[0]) for cache in self.caches
        ]


def write_test_certificates(directory) -> dict[str, str] | None:
    """A throwaway CA and one node certificate it signed (P-256, valid one day, subjectAltName
    `DNS:pdcluster-kv, IP:127.0.0.1`, usable as server and client), written with the `openssl` CLI into
    `directory`: `{"cert_file", "key_file", "ca_file"}` paths. None when `openssl` is not installed."""
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("openssl") is None:
        return None
    d = Path(directory)
    ext = d / "node.ext"
    ext.write_text("subjectAltName=DNS:pdcluster-kv,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    commands = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca"],
        ["req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=pdcluster-kv"],
        ["x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "node.pem", "-days", "1", "-extfile", "node.ext"],
    ]  # fmt: skip
    for args in commands:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    return {"cert_file": str(d / "node.pem"), "key_file": str(d / "node.key"), "ca_file": str(d / "ca.pem")}
