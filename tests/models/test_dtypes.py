import pytest
import torch

from pdcluster.models.dtypes import DTYPES, MODEL_DTYPE_NAMES, MODEL_DTYPES, dtype_name, torch_dtype


def test_names_map_to_torch_dtypes_and_back() -> None:
    assert MODEL_DTYPE_NAMES == ("float32", "bfloat16", "float16")
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("int8") is torch.int8
    assert {name: dtype_name(dtype) for name, dtype in DTYPES.items()} == {name: name for name in DTYPES}


def test_unknown_name_names_the_field_and_the_valid_names() -> None:
    with pytest.raises(
        ValueError,
        match=r"^dtype: unknown dtype 'fp8'; expected one of \['bfloat16', 'float16', 'float32'\]$",
    ):
        torch_dtype("fp8", "dtype", MODEL_DTYPES)
    with pytest.raises(ValueError, match="int8"):  # int8 is a KV/wire dtype, not a model dtype
        torch_dtype("int8", "dtype", MODEL_DTYPES)
    with pytest.raises(ValueError, match="has no name"):
        dtype_name(torch.float64)
