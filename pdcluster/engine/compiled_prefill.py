"""The ragged-batch (prefill) forward compiled once, at load, as one graph dynamic in the token count."""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pdcluster.engine.compiled_forward import stack_dense_moe_weights
from pdcluster.kernels.paged_mla import paged_mla_attention, write_kv
from pdcluster.models.deepseek_v3 import DeepseekV3MoE

# Steps of at most this many tokens run compiled by default (`CompiledPrefillForward.max_num_tokens`).
DEFAULT_MAX_NUM_TOKENS = 64

_STEPS: dict[str, dict[str, Any]] = {}
_handles = itertools.count()


@torch.library.custom_op("pdcluster::prefill_attention", mutates_args=())
def _prefill_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent_kv: torch.Tensor, handle: str, layer_idx: int
) -> torch.Tensor:
    step = _STEPS[handle]
    runner, batch = step["runner"](), step["batch"]
    write_kv(runner.kv_caches[layer_idx], latent_kv, batch.slot_mapping, runner.kv_scales[layer_idx])
    if step["on_layer_kv"] is not None:
        step["on_layer_kv"](layer_idx, latent_kv, batch)
    return paged_mla_attention(
        q_nope,
        q_pe,
        runner.kv_caches[layer_idx],
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        runner.model.model.layers[layer_idx].self_attn.kv_b_proj.weight,
        runner.config.softmax_scale,
        kv_scale=runner.kv_scales[layer_idx],
    )


@_prefill_attention.register_fake
def _(q_nope, q_pe, latent_kv, handle, layer_idx):
    v_head_dim = _STEPS[handle]["runner"]().config.v_head_dim
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], v_head_dim)


class CompiledPrefillForward:
    """The compiled ragged-batch forward of one `ModelRunner` (see the module docstring)."""

    def __init__(self, runner, max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS) -> None:
        self.runner = runner
        self.max_num_tokens = max_num_tokens
        self.handle = f"runner-{next(_handles)}"
        _STEPS[self.handle] = {"runner": weakref.ref(runner), "batch": None, "on_layer_kv": None}
        weakref.finalize(self, _STEPS.pop, self.handle, None)
        self.num_compiled_steps = 0
        self.num_eager_fallbacks = 0
        stack_dense_moe_weights(runner.model)  # before tracing: the graph reads the stacked weights
        self._graph = torch.compile(self._forward_fn(), fullgraph=True)
        self._ready = False

    def _forward_fn(self) -> Callable:
        model, handle = self.runner.model, self.handle
        prefill_attention = torch.ops.pdcluster.prefill_attention

        def attention_fn(layer):
            def attention(q_nope, q_pe, latent_kv):
                out = prefill_attention(q_nope, q_pe, latent_kv, handle, layer.layer_idx)
                return layer.self_attn.o_proj(out.flatten(1))

            return attention

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            cos, sin = model.model.rope(positions)
            hidden = model.model.embed_tokens(input_ids)
            for layer in model.main_layers:
                mlp = layer.mlp.forward_dense if isinstance(layer.mlp, DeepseekV3MoE) else None
                hidden, _ = layer.block(hidden, cos, sin, attention_fn(layer), mlp=mlp)
            return model.model.norm(hidden)

        return forward

    def accepts(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs here (2 .."""
        return self._ready and 2 <= num_tokens <= self.max_num_tokens

    def warm_up(self) -> float:
        """Compile the graph on a dummy step (one request of 2 tokens in block 0, then that block zeroed: no
        request holds a block before the engine starts).
        Raises Exception: whatever compiling raised; the forward then stays unusable (`accepts` is False)."""
        from pdcluster.engine.model_runner import build_model_input

        start = time.perf_counter()
        runner = self.runner
        batch = build_model_input([[0, 0]], [0], [[0]], runner.block_size, runner.device)
        with torch.inference_mode():
            self._call(batch, None)
            for cache in runner.kv_caches:
                cache[0].zero_()
        self._ready = True
        return time.perf_counter() - start

    def _call(self, batch, on_layer_kv) -> torch.Tensor:
        input_ids, positions = batch.input_ids, batch.positions
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        step = _STEPS[self.handle]
        step["batch"], step["on_layer_kv"] = batch, on_layer_kv
        try:
            return self._graph(input_ids, positions)
        finally:
            step["batch"] = step["on_layer_kv"] = None

    def __call__(self, batch, on_layer_kv=None) -> torch.Tensor | None:
        """Run a step (`accepts` said yes): writes its KV, calls `on_layer_kv(layer_idx, latent_kv, batch)`
        per layer.
        """
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                hidden = self._call(batch, on_layer_kv)
        except RuntimeError as e:
            if "Detected recompile" not in str(e):
                raise
            self.num_eager_fallbacks += 1
            return None
        self.num_compiled_steps += 1
        return hidden
