"""Checkpoint factories: Hugging Face-format directories written by transformers, by hand (sharded, FP8)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdcluster.models.config import DeepseekV3Config
from tests.conftest import hf_config_for, randomize_

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0


def write_checkpoint(
    path: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    num_shards: int = 1,
    shard_of: Callable[[str], int] | None = None,
) -> Path:
    """Write `config.json` and the tensors as `model.safetensors`, or as `num_shards` shards plus
    `model.safetensors.index.json` (tensor i of the sorted names goes to shard `i % num_shards` unless
    `shard_of(name)` says otherwise). Returns `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if num_shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    shard_ids = {name: (shard_of(name) if shard_of else i % num_shards) for i, name in enumerate(names)}
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    for shard, file in enumerate(files):
        part = {name: tensors[name] for name in names if shard_ids[name] == shard}
        assert part, f"shard {shard} would be empty"
        save_file(part, str(path / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: files[shard_ids[name]] for name in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """`(config dict, tensors)` of a single-file checkpoint directory."""
    with safe_open(path / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return json.loads((path / "config.json").read_text()), tensors


def quantize_fp8_blockwise(
    weight: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float `[out, in]` weight to float8_e4m3fn with one scale per block.

    Returns `(fp8 [out, in], scale_inv [ceil(out / bo), ceil(in / bi)] float32)`, with each block's
    `scale_inv = amax(block) / 448`, so `fp8 * scale_inv` approximates the weight (ragged edge blocks
    included).
    """
    out_features, in_features = weight.shape
    block_out, block_in = block_size
    rows, cols = math.ceil(out_features / block_out), math.ceil(in_features / block_in)
    fp8 = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            block = weight[i * block_out : (i + 1) * block_out, j * block_in : (j + 1) * block_in].float()
            scale = block.abs().max().clamp(min=1e-12) / FP8_MAX
            scale_inv[i, j] = scale
            q = (block / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            fp8[i * block_out : (i + 1) * block_out, j * block_in : (j + 1) * block_in] = q
    return fp8, scale_inv


def dequantize_reference(
    fp8: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """Block-by-block float32 reference: `out[block (i, j)] = fp8[block].float() * scale_inv[i, j]`."""
    block_out, block_in = block_size
    out = torch.empty(fp8.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows = slice(i * block_out, (i + 1) * block_out)
            cols = slice(j * block_in, (j + 1) * block_in)
            out[rows, cols] = fp8[rows, cols].float() * scale_inv[i, j]
    return out


def save_hf_checkpoint(config: DeepseekV3Config, path: Path, seed: int = 0) -> Any:
    """Build `transformers.DeepseekV3ForCausalLM` for `config`, randomize every weight and the router's
    `e_score_correction_bias`, `save_pretrained` it to `path`, and return it (float32, eval mode).
    transformers writes no MTP tensors."""
    from transformers import DeepseekV3ForCausalLM as HFDeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = HFDeepseekV3ForCausalLM(hf_config_for(config)).float().eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model
