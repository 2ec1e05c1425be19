"""Load and save Hugging Face-format DeepSeek-V3 checkpoints.

The MTP module is layer `num_hidden_layers`; its copies of the embedding and head are skipped (the model
shares the main ones), and a checkpoint without MTP tensors loads with MTP disabled. FP8 e4m3 weights with
`weight_scale_inv` (128x128 blocks, DeepSeek-V3 report section 3.3.2) are dequantized on load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pdcluster.kernels.rope import rope_inv_freq
from pdcluster.models.config import DeepseekV3Config
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.expert_placement import ExpertPlacement, moe_layer_indices

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_HEADER_DTYPES = ("F8_E4M3",)  # how safetensors headers spell FP8_DTYPES
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and the tensors."""


def _regular_file(file: Path) -> None:
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{file}: not a regular file")


def read_safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's header, checked against the file's size.

    Raises CheckpointError naming the file: unreadable, not regular, truncated or not safetensors.
    """
    _regular_file(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
            if header_len is None or header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{file}: not a safetensors file ({size} bytes; it starts with an 8-byte header length)"
                )
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{file}: truncated: its header is {header_len} bytes but the file has {size} (an "
                    "incomplete download or copy?)"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
        header.pop("__metadata__", None)
        data_end = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
        for entry in header.values():
            entry["shape"] = tuple(int(d) for d in entry["shape"])
            str(entry["dtype"])
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise CheckpointError(f"{file}: not a safetensors file (its header does not parse: {exc})") from None
    data_bytes = size - 8 - header_len
    if data_end > data_bytes:
        raise CheckpointError(
            f"{file}: truncated: its header declares {data_end} bytes of tensor data but the file holds "
            f"{data_bytes} (an incomplete download or copy?)"
        )
    return header


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Each tensor name -> its safetensors file; CheckpointError for no weights or a bad index."""
    index = path / INDEX_FILE
    if index.exists():
        _regular_file(index)
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("weight_map is not a mapping of tensor names to file names")
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise CheckpointError(f"{index}: shards listed but not present: {', '.join(missing)}")
        return {name: path / f for name, f in weight_map.items()}
    single = path / SINGLE_FILE
    if single.exists():
        return {name: single for name in read_safetensors_header(single)}
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")


def dequantize_fp8_blockwise(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:
    """Blockwise FP8 dequantization: block (i, j) is `weight[block] * scale_inv[i, j]`.

    weight: [out_features, in_features] float8_e4m3fn
    scale_inv: [ceil(out / block_out), ceil(in / block_in)] float32
    returns [out_features, in_features] float32
    Raises CheckpointError if `scale_inv` does not cover the weight.
    """
    out_features, in_features = weight.shape
    block_out, block_in = block_size
    expected = (math.ceil(out_features / block_out), math.ceil(in_features / block_in))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
            f"with block size {block_size} (expected {expected})"
        )
    scale = scale_inv.float().repeat_interleave(block_out, 0).repeat_interleave(block_in, 1)
    return weight.float() * scale[:out_features, :in_features]


def _iter_tensors(files: dict[str, Path], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, file_names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                for name in file_names:
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """What `inspect_checkpoint` found: the config, each tensor's file and its expected shape."""

    config: DeepseekV3Config
    files: dict[str, Path]
    expected: dict[str, tuple[int, ...]]


def inspect_checkpoint(path: str | Path) -> CheckpointLayout:
    """Check a checkpoint directory from its headers only, without reading tensor data.

    Raises FileNotFoundError (no directory or `config.json`), ValueError (bad config) or CheckpointError.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path}: no config.json")
    config = DeepseekV3Config.from_json_file(config_file)
    files = checkpoint_files(path)
    entries: dict[str, dict[str, Any]] = {}
    for file in sorted(set(files.values())):
        header = read_safetensors_header(file)
        absent = sorted(name for name, f in files.items() if f == file and name not in header)
        if absent:
            raise CheckpointError(
                f"{path / INDEX_FILE}: lists {len(absent)} tensor(s) in {file.name} that it does not hold, "
                f"e.g. {', '.join(absent[:3])}"
            )
        entries.update({name: header[name] for name, f in files.items() if f == file})

    num_layers = config.num_hidden_layers
    mtp_prefixes = tuple(f"model.layers.{num_layers + k}." for k in range(config.num_nextn_predict_layers))
    if mtp_prefixes and not any(name.startswith(mtp_prefixes) for name in files):
        logger.warning(
            "%s: config has %d MTP module(s) but no tensor for layer %d; loading with MTP disabled",
            path,
            config.num_nextn_predict_layers,
            num_layers,
        )
        config = dataclasses.replace(config, num_nextn_predict_layers=0)

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    missing = sorted(name for name in expected if name not in files)
    if missing:
        shown = "\n  ".join(missing[:50]) + (
            f"\n  ... and {len(missing) - 50} more" if len(missing) > 50 else ""
        )
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint:\n  {shown}")

    block_size = tuple((config.quantization_config or {}).get("weight_block_size", (128, 128)))
    bad_shapes: list[str] = []
    for name, shape in expected.items():
        entry = entries[name]
        if entry["dtype"] in FP8_HEADER_DTYPES:
            scale_name = name + SCALE_SUFFIX
            if scale_name not in files:
                raise CheckpointError(f"{path}: FP8 tensor {name} has no {scale_name}")
            scale_shape, weight_shape = entries[scale_name]["shape"], entry["shape"]
            if len(weight_shape) == 2:
                covering = tuple(math.ceil(n / b) for n, b in zip(weight_shape, block_size, strict=True))
                if scale_shape != covering:
                    raise CheckpointError(
                        f"{path}: {name}: weight_scale_inv shape {scale_shape} does not match weight "
                        f"{weight_shape} with block size {block_size} (expected {covering})"
                    )
        if entry["shape"] != shape:
            bad_shapes.append(f"{name}: expected {shape}, got {entry['shape']}")
    if bad_shapes:
        raise CheckpointError(f"{path}: tensor(s) with unexpected shape:\n  " + "\n  ".join(bad_shapes))
    return CheckpointLayout(config=config, files=files, expected=expected)


def check_checkpoint_dir(path: str | Path) -> None:
    """`inspect_checkpoint`, plus a `tokenizer.json` whose vocabulary fits the model.

    Raises as `inspect_checkpoint`; CheckpointError for a missing or unloadable tokenizer.
    """
    from pdcluster.models.tokenizer import Tokenizer

    layout = inspect_checkpoint(path)
    tokenizer_file = Path(path) / TOKENIZER_FILE
    if not tokenizer_file.exists():
        raise CheckpointError(f"{tokenizer_file}: no {TOKENIZER_FILE} in the checkpoint directory")
    _regular_file(tokenizer_file)
    try:
        tokenizer = Tokenizer.from_dir(path)
    except Exception as exc:  # noqa: BLE001 - `tokenizers` raises a bare Exception for a file it cannot parse
        raise CheckpointError(f"{tokenizer_file}: cannot load: {exc}") from None
    if tokenizer.vocab_size > layout.config.vocab_size:
        raise CheckpointError(
            f"{tokenizer_file}: {tokenizer.vocab_size} tokens, but config.json's vocab_size is "
            f"{layout.config.vocab_size}"
        )


def expert_sources(model: DeepseekV3ForCausalLM, placement: ExpertPlacement, ep_rank: int) -> dict[str, str]:
    """Checkpoint tensor name of each routed-expert tensor of EP rank `ep_rank`'s model."""
    rows = {layer: row for row, layer in enumerate(moe_layer_indices(model.config))}
    sources: dict[str, str] = {}
    for name in model.state_dict():
        parts = name.split(".")  # model.layers.{i}.mlp.experts.{s}.{proj}.weight
        if len(parts) > 5 and parts[3:5] == ["mlp", "experts"]:
            layer, slot = int(parts[2]), int(parts[5])
            logical = placement.local_logical_experts(rows[layer], ep_rank)[slot]
            sources[name] = ".".join([*parts[:5], str(logical), *parts[6:]])
    return sources


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    placement: ExpertPlacement | None = None,
    ep_rank: int = 0,
) -> DeepseekV3ForCausalLM:
    """Build a `DeepseekV3ForCausalLM` from a checkpoint directory.

    dtype: parameter dtype (the router's `e_score_correction_bias` stays float32).
    placement, ep_rank: build EP rank `ep_rank`'s model, reading only its routed experts' tensors.
    Raises FileNotFoundError, ValueError (config) or CheckpointError (missing or misshapen tensors),
    found from the headers before any tensor is read.
    """
    path = Path(path)
    layout = inspect_checkpoint(path)
    config, files, expected = layout.config, layout.files, layout.expected
    num_layers = config.num_hidden_layers
    mtp_prefixes = tuple(f"model.layers.{num_layers + k}." for k in range(config.num_nextn_predict_layers))
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, placement.num_local_experts if placement else None)
    sources = expert_sources(model, placement, ep_rank) if placement is not None else {}
    targets_of: dict[str, list[str]] = {}  # checkpoint name -> model names it fills
    for target in model.state_dict():
        if target in expected or target in sources:
            targets_of.setdefault(sources.get(target, target), []).append(target)

    block_size = tuple((config.quantization_config or {}).get("weight_block_size", (128, 128)))
    state: dict[str, torch.Tensor] = {}
    bad_shapes: list[str] = []
    for name, tensor in _iter_tensors(files, list(targets_of)):
        if tensor.dtype in FP8_DTYPES:
            scale_name = name + SCALE_SUFFIX
            if scale_name not in files:
                raise CheckpointError(f"{path}: FP8 tensor {name} has no {scale_name}")
            ((_, scale_inv),) = _iter_tensors(files, [scale_name])
            try:
                tensor = dequantize_fp8_blockwise(tensor, scale_inv, block_size)  # type: ignore[arg-type]
            except CheckpointError as exc:
                raise CheckpointError(f"{path}: {name}: {exc}") from exc
        if tuple(tensor.shape) != expected[name]:
            bad_shapes.append(f"{name}: expected {expected[name]}, got {tuple(tensor.shape)}")
            continue
        keep_fp32 = name.endswith("e_score_correction_bias")
        tensor = tensor.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
        for i, target in enumerate(targets_of[name]):
            state[target] = tensor if i == 0 else tensor.clone()
    if bad_shapes:
        raise CheckpointError(f"{path}: tensor(s) with unexpected shape:\n  " + "\n  ".join(bad_shapes))

    ignored = [
        n
        for n in files
        if n not in expected
        and not n.endswith(SCALE_SUFFIX)
        and not n.startswith(mtp_prefixes)
        and not n.startswith(f"model.layers.{num_layers}.")
    ]
    if ignored:
        logger.warning("%s: ignoring %d unexpected tensor(s), e.g. %s", path, len(ignored), ignored[:5])

    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rope_inv_freq = rope_inv_freq(config).to(device)
    return model.eval()


def save_checkpoint(model: DeepseekV3ForCausalLM, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` and `model.safetensors` (public names); `dtype` for floats, router bias float32."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    if dtype is not None:
        config = dataclasses.replace(config, torch_dtype=str(dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    state = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point() and not name.endswith("e_score_correction_bias"):
            t = t.to(dtype)
        state[name] = t.contiguous().cpu()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / SINGLE_FILE), metadata={"format": "pt"})
