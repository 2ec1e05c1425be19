"""The one table of dtype names: what a config, a CLI flag or a handoff header names -> the torch dtype.

`MODEL_DTYPES` are the parameter (and activation) dtypes a checkpoint may be loaded in; `DTYPES` adds
int8, the element dtype of an int8 KV cache and of an int8 KV wire. Names are torch's own spellings.
"""

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
    """`"bfloat16"` -> `torch.bfloat16`.

    Args:
        name: a key of `allowed`.
        what: what the name is for (a field or flag name), quoted in the error.
        allowed: the table to look in (`DTYPES`, or `MODEL_DTYPES` for a model dtype).

    Raises:
        ValueError: an unknown name; the message names `what` and the valid names.
    """
    try:
        return allowed[name]
    except KeyError:
        raise ValueError(f"{what}: unknown dtype {name!r}; expected one of {sorted(allowed)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (inverse of `torch_dtype` over `DTYPES`).

    Raises:
        ValueError: a dtype without a name in `DTYPES`.
    """
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no name; expected one of {sorted(DTYPES)}")
