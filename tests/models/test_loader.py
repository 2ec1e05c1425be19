"""Checkpoint loading: our own save/load round trip with the MTP module, the public MTP layout, sharded
checkpoints, FP8 block dequantization and every error the loader promises."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pdcluster.models.config import DeepseekV3Config
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.loader import (
    CheckpointError,
    dequantize_fp8_blockwise,
    load_checkpoint,
    save_checkpoint,
)
from tests.conftest import random_ids, tiny_config, tiny_model
from tests.models.conftest import (
    dequantize_reference,
    quantize_fp8_blockwise,
    read_checkpoint,
    write_checkpoint,
)

MTP = "model.layers.2."  # the tiny config has 2 main layers, so the MTP module is layer 2


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Tests in this file that draw from torch's global generator draw the same numbers on every run."""
    torch.manual_seed(0)


@pytest.fixture
def model() -> DeepseekV3ForCausalLM:
    return tiny_model(seed=3)


@pytest.fixture
def saved(tmp_path, model) -> Path:
    """Our tiny model with its MTP module, written by `save_checkpoint`."""
    save_checkpoint(model, tmp_path / "saved")
    return tmp_path / "saved"


def outputs(model: DeepseekV3ForCausalLM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logits, mtp hidden, mtp logits)` on fixed inputs."""
    ids = random_ids(model.config, batch=2, seq_len=9, seed=4)
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        mtp_hidden, mtp_logits = model.mtp_forward(hidden[:, :-1], ids[:, 1:])
        return model(ids), mtp_hidden, mtp_logits


def assert_same_model(a: DeepseekV3ForCausalLM, b: DeepseekV3ForCausalLM) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, tensor in state_a.items():
        assert state_b[name].dtype == tensor.dtype, name
        assert torch.equal(state_b[name], tensor), name
    # Equal weights in two model objects can still round differently: the loaded tensors sit at other
    # addresses (alignment) than the originals, and oneDNN/MKL pick kernels and summation orders by
    # alignment and CPU (2.4e-7 was seen on an AVX-512 machine). The weights are compared exactly above;
    # this checks what loading derives (buffers, the MTP head and embedding) at a few float32 ulps of O(1).
    for x, y in zip(outputs(a), outputs(b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


# ---- round trips ------------------------------------------------------------------------------------


def test_save_load_round_trip_keeps_mtp(model, saved) -> None:
    _, tensors = read_checkpoint(saved)
    assert set(tensors) == set(model.state_dict())
    mtp_names = {name for name in tensors if name.startswith(MTP)}
    for part in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        assert MTP + part in mtp_names
    assert MTP + "mlp.gate.e_score_correction_bias" in mtp_names  # the MTP block is a MoE layer

    loaded = load_checkpoint(saved)
    assert len(loaded.mtp_layers) == 1
    assert loaded.config == model.config
    assert_same_model(model, loaded)


def test_public_layout_mtp_copies_of_embedding_and_head_are_accepted(model, saved, caplog) -> None:
    """Public checkpoints repeat the embedding and output head under the MTP layer; the model shares the
    main ones, so the copies load silently and change nothing."""
    config, tensors = read_checkpoint(saved)
    tensors[MTP + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[MTP + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    write_checkpoint(saved, config, tensors)

    with caplog.at_level(logging.WARNING, logger="pdcluster.models.loader"):
        loaded = load_checkpoint(saved)
    assert caplog.text == ""
    assert_same_model(model, loaded)


def test_unknown_tensor_is_ignored_with_a_warning(model, saved, caplog) -> None:
    config, tensors = read_checkpoint(saved)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    write_checkpoint(saved, config, tensors)
    with caplog.at_level(logging.WARNING, logger="pdcluster.models.loader"):
        loaded = load_checkpoint(saved)
    assert "ignoring 1 unexpected tensor(s)" in caplog.text
    assert "rotary_emb.inv_freq" in caplog.text
    assert_same_model(model, loaded)


@pytest.mark.parametrize("num_shards", [2, 3])
def test_sharded_checkpoint_equals_single_file(model, saved, tmp_path, num_shards) -> None:
    config, tensors = read_checkpoint(saved)
    sharded = write_checkpoint(tmp_path / "sharded", config, tensors, num_shards=num_shards)
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) == num_shards

    assert_same_model(model, load_checkpoint(sharded))


def test_sharded_checkpoint_with_a_missing_shard(saved, tmp_path) -> None:
    config, tensors = read_checkpoint(saved)
    sharded = write_checkpoint(tmp_path / "sharded", config, tensors, num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"shards listed but not present: model-00002-of-00002\.safetensors"
    ):
        load_checkpoint(sharded)


def test_bfloat16_save_keeps_router_bias_float32(model, tmp_path) -> None:
    save_checkpoint(model, tmp_path, dtype=torch.bfloat16)
    config, tensors = read_checkpoint(tmp_path)
    assert config["torch_dtype"] == "bfloat16"
    for name, tensor in tensors.items():
        wanted = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert tensor.dtype == wanted, name

    loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    reference = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            assert tensor.dtype == torch.float32
            assert torch.equal(tensor, reference[name])
        else:
            assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


# ---- FP8 --------------------------------------------------------------------------------------------

FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def fp8_error_bound(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:
    """Round-to-nearest e4m3 (3 mantissa bits): at most 2**-4 relative error for normal numbers, plus half
    the subnormal spacing (2**-10 in block units) for values near zero."""
    block_scale = dequantize_reference(
        torch.ones(weight.shape).to(torch.float8_e4m3fn), scale_inv, block_size
    )
    return 2.0**-4 * weight.abs() + 2.0**-10 * block_scale


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (1, 129), (576, 136), (7, 5)])
def test_dequantize_fp8_blockwise_matches_block_reference(shape) -> None:
    weight = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # blocks with very different ranges
    fp8, scale_inv = quantize_fp8_blockwise(weight)
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))

    out = dequantize_fp8_blockwise(fp8, scale_inv, (128, 128))
    assert out.dtype == torch.float32
    assert torch.equal(out, dequantize_reference(fp8, scale_inv))
    assert ((out - weight).abs() <= fp8_error_bound(weight, scale_inv, (128, 128))).all()


def test_dequantize_fp8_rejects_a_scale_that_does_not_cover_the_weight() -> None:
    fp8, scale_inv = quantize_fp8_blockwise(torch.randn(300, 200))
    with pytest.raises(CheckpointError, match=r"expected \(3, 2\)"):
        dequantize_fp8_blockwise(fp8, scale_inv[:2], (128, 128))


def fp8_config() -> DeepseekV3Config:
    """Dimensions above 128 and not multiples of it, so weights span ragged 128x128 blocks."""
    return tiny_config(
        vocab_size=96,
        hidden_size=136,
        intermediate_size=200,
        moe_intermediate_size=24,
        num_attention_heads=2,
        q_lora_rank=160,
        kv_lora_rank=144,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
    )


def write_fp8_checkpoint(
    path: Path, model: DeepseekV3ForCausalLM, block_size: tuple[int, int]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantize every `*_proj.weight` (as the public checkpoints do) into a 2-shard checkpoint whose scales
    all sit in the other shard from their weights. Returns `{name: (fp8, scale_inv)}`."""
    config = model.config.to_dict()
    config["quantization_config"] = {**FP8_QUANTIZATION, "weight_block_size": list(block_size)}
    tensors = dict(model.state_dict())
    quantized = {}
    for name in list(tensors):
        if name.endswith("_proj.weight"):
            fp8, scale_inv = quantize_fp8_blockwise(tensors[name], block_size)
            tensors[name], tensors[name + "_scale_inv"] = fp8, scale_inv
            quantized[name] = (fp8, scale_inv)
    write_checkpoint(path, config, tensors, num_shards=2, shard_of=lambda n: int(n.endswith("_scale_inv")))
    return quantized


@pytest.mark.parametrize("block_size", [(128, 128), (16, 32)], ids=["128x128", "16x32"])
def test_fp8_checkpoint_is_dequantized_on_load(tmp_path, block_size) -> None:
    model = tiny_model(fp8_config(), seed=5)
    quantized = write_fp8_checkpoint(tmp_path, model, block_size)
    ragged = [n for n, (fp8, _) in quantized.items() if any(d > 128 and d % 128 for d in fp8.shape)]
    assert ragged, "the config should produce weights spanning ragged blocks"
    assert any(n.startswith("model.layers.2.") for n in quantized)  # the MTP module is quantized too

    loaded = load_checkpoint(tmp_path)
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        if name in quantized:
            fp8, scale_inv = quantized[name]
            assert torch.equal(tensor, dequantize_reference(fp8, scale_inv, block_size)), name
            bound = fp8_error_bound(original[name], scale_inv, block_size)
            assert ((tensor - original[name]).abs() <= bound).all(), name
        else:
            assert torch.equal(tensor, original[name]), name
    ids = random_ids(model.config, seed=6)
    with torch.no_grad():
        assert torch.isfinite(loaded(ids)).all()


# ---- errors -----------------------------------------------------------------------------------------


def test_missing_tensors_are_all_listed(saved) -> None:
    config, tensors = read_checkpoint(saved)
    removed = ["lm_head.weight", "model.layers.1.mlp.experts.5.up_proj.weight", MTP + "eh_proj.weight"]
    for name in removed:
        del tensors[name]
    write_checkpoint(saved, config, tensors)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(saved)
    message = str(info.value)
    assert "3 tensor(s) missing" in message
    for name in removed:
        assert name in message


def test_unexpected_shapes_name_tensor_expected_and_got(saved) -> None:
    config, tensors = read_checkpoint(saved)
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(40, 16)
    tensors["model.norm.weight"] = torch.zeros(33)
    write_checkpoint(saved, config, tensors)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(saved)
    message = str(info.value)
    assert "model.layers.0.self_attn.kv_b_proj.weight: expected (80, 16), got (40, 16)" in message
    assert "model.norm.weight: expected (32,), got (33,)" in message


def test_unsupported_model_type(saved) -> None:
    config, _ = read_checkpoint(saved)
    (saved / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json.*unsupported model_type 'llama'.*deepseek_v3"):
        load_checkpoint(saved)


def test_invalid_config_field_names_field_and_file(saved) -> None:
    config, _ = read_checkpoint(saved)
    (saved / "config.json").write_text(json.dumps({**config, "n_group": 3}))
    with pytest.raises(
        ValueError, match=r"config\.json: config field 'n_group': must divide n_routed_experts=8"
    ):
        load_checkpoint(saved)


def test_fp8_weight_without_scale(saved) -> None:
    config, tensors = read_checkpoint(saved)
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    write_checkpoint(saved, config, tensors)
    with pytest.raises(CheckpointError, match=rf"FP8 tensor {name} has no {name}_scale_inv"):
        load_checkpoint(saved)


def test_fp8_weight_with_wrong_scale_shape_names_the_tensor(saved) -> None:
    config, tensors = read_checkpoint(saved)
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name], _ = quantize_fp8_blockwise(tensors[name])
    tensors[name + "_scale_inv"] = torch.ones(2, 1)
    write_checkpoint(saved, config, tensors)
    with pytest.raises(CheckpointError, match=rf"{name}: weight_scale_inv shape \(2, 1\).*expected \(1, 1\)"):
        load_checkpoint(saved)


def test_missing_config_json(saved) -> None:
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(saved)


def test_missing_directory(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nowhere")


def test_no_weights_file(saved) -> None:
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_checkpoint(saved)
