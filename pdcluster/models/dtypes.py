"""The one table of dtype names (torch's spellings); `DTYPES` adds int8 to `MODEL_DTYPES`."""

from __future__ import annotations

import torch

MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
MODEL_DTYPE_NAMES: tuple[str, ...] = tuple(MODEL_DTYPES)
DTYPES: dict[str, torch.dtype] = {**MODEL_DTYPES, "int8": torch.int8}


def torch_dtype(name: str, what: str = "dtype", allowed: dict[str, torch.dtype] = DTYPES) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`, looked up in `allowed`; ValueError naming `what` if unknown."""
    try:
        return allowed[name]
    except KeyError:
        raise ValueError(f"{what}: unknown dtype {name!r}; expected one of {sorted(allowed)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`; ValueError for a dtype not in `DTYPES`."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no name; expected one of {sorted(DTYPES)}")
