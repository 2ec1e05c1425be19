"""An int8 KV cache on both sides with an int8 wire: the prompt's cache bytes (int8 values and float32
scales) arrive in decode's cache exactly as prefill's cache holds them, through the real gRPC transport
between two in-process engines (the tiny bundled model). Bit-exact is the right bar: bytes are copied,
no float math runs on them.

Byte equality alone does not prove that nothing was re-quantized: per-token absmax quantization of a
row dequantized from int8 gives the same bytes back here (the old path, five (de)quantizations, was slow
rather than lossy). So the test also checks the path: prefill's engine hands out its int8 bytes, and
decode's receiver hands int8 + scales to `on_layer`, never a dequantized float tensor.
"""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm import LLMEngine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kvtransfer.base import HandoffExtras, HandoffMeta, ReceivedLayer
from pdcluster.kvtransfer.grpc_transport import GrpcKVSender, KVReceiverServer
from pdcluster.models import bundled_checkpoint_dir
from tests.kvtransfer.conftest import bits_equal

PROMPT = 'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the arguments and'
DTYPE = "bfloat16"  # the serving dtype
WAIT_S = 30.0  # generous bound on waits that end much sooner; never a measured threshold


@pytest.fixture(scope="module")
def model():
    return LLMEngine(EngineConfig(model=str(bundled_checkpoint_dir()), num_kv_blocks=16, dtype=DTYPE)).model


def _int8_engine(model, **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(bundled_checkpoint_dir()),
        num_kv_blocks=32,
        kv_cache_dtype="int8",
        block_size=4,
        dtype=DTYPE,
        **kw,
    )
    return LLMEngine(config, model=model)


def _cache_bytes(engine: LLMEngine, slots: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [n, kv_dim], float32 scales [n]) at `slots` of one layer of `engine`'s cache."""
    cache, scales = engine.runner.kv_caches[layer_idx], engine.runner.kv_scales[layer_idx]
    return cache.view(-1, cache.shape[-1])[slots].clone(), scales.view(-1)[slots].clone()


def _hand_off(model):
    """One prompt prefilled on an int8-cache engine and streamed over gRPC (int8 wire) into the blocks an
    int8-cache decode engine reserved. Returns (prefill's cache bytes per layer, decode's per layer, the
    dtypes `on_layer` received per layer)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prefill = _int8_engine(model, max_num_batched_tokens=8)  # chunked: the prompt spans several steps
    decode = _int8_engine(model)
    prompt = prefill.tokenizer.encode(PROMPT)
    num_layers = model.config.num_hidden_layers
    server = KVReceiverServer("127.0.0.1", 0, int8_passthrough=True)  # as DecodeWorker sets for an int8 cache
    received_dtypes: dict[int, tuple[torch.dtype, torch.dtype | None]] = {}
    sender = GrpcKVSender(server.address)
    try:
        assert decode.reserve_remote_prefill("r", prompt, params)
        request = decode.scheduler.reserved["r"]
        decode_slots = torch.tensor(decode.scheduler.block_manager.slot_mapping(request, 0, len(prompt)))

        def write(layer_idx: int, layer: ReceivedLayer) -> None:
            received_dtypes[layer_idx] = (
                layer.latent.dtype,
                None if layer.scale is None else layer.scale.dtype,
            )
            decode.write_prompt_kv("r", layer_idx, layer.latent, layer.scale)

        kv_dim = model.config.kv_lora_rank + model.config.qk_rope_head_dim
        handoff = HandoffMeta("r", num_layers, len(prompt), kv_dim, dtype=DTYPE, wire_dtype="int8")
        meta = server.expect(handoff, on_layer=write)
        sender.begin(meta)
        prefill_bytes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def send(request_id: str, layer_idx: int, latent: torch.Tensor, scale: torch.Tensor | None) -> None:
            assert latent.dtype == torch.int8 and scale is not None  # the int8 cache's own bytes
            prefill_bytes[layer_idx] = (latent.clone(), scale.clone())
            sender.send_layer(request_id, layer_idx, latent, scale)

        prefill.add_request(prompt, params, request_id="r", prefill_only=True)
        while prefill.has_unfinished_requests():
            prefill.step(on_prompt_kv=send)
        result = prefill.pop_prefill_result("r")
        sender.finish("r", HandoffExtras(first_token_id=result.first_token_id))
        received = server.wait("r", WAIT_S)
        assert received.num_wire_bytes == num_layers * len(prompt) * (
            kv_dim + 4
        )  # int8 values + a float32 scale per token
        assert sorted(prefill_bytes) == list(range(num_layers))
        decode_bytes = {i: _cache_bytes(decode, decode_slots, i) for i in range(num_layers)}
        server.release("r")
        assert sender.flush(WAIT_S) == {}
        decode.release_remote_prefill("r")
        return prefill_bytes, decode_bytes, received_dtypes
    finally:
        sender.close()
        server.close(grace_s=0)


def test_int8_cache_bytes_pass_through_the_int8_wire_unchanged(model):
    prefill_bytes, decode_bytes, received_dtypes = _hand_off(model)
    assert received_dtypes == {i: (torch.int8, torch.float32) for i in range(model.config.num_hidden_layers)}
    for layer_idx, (values, scales) in prefill_bytes.items():
        assert bool(scales.gt(0).all()) and bool(values.ne(0).any())  # real KV, not an empty cache
        got_values, got_scales = decode_bytes[layer_idx]
        assert bits_equal(got_values, values), f"layer {layer_idx}: int8 values differ"
        assert bits_equal(got_scales, scales), f"layer {layer_idx}: scales differ"
