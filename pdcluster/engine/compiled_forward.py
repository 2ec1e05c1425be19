"""The decode forward compiled once, at load, over a fixed set of padded batch-size buckets."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdcluster.kernels.mla import split_kv_b_weight
from pdcluster.kernels.mla_decode import mla_decode_attention
from pdcluster.kernels.paged_mla import write_kv
from pdcluster.models.deepseek_v3 import DeepseekV3MoE
from pdcluster.models.moe_dispatch import LocalDispatcher


def batch_size_buckets(max_num_reqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8 up to `max_num_reqs` (vLLM's capture sizes)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_reqs]
    sizes += list(range(8, max_num_reqs, 8))
    return sorted(set(sizes + [max_num_reqs]))


def stack_dense_moe_weights(model) -> None:
    """Build every MoE layer's `dense_weights` (expert parameters re-pointed at views of them)."""
    for module in model.modules():
        if isinstance(module, DeepseekV3MoE):
            module.dense_weights()


def _progress(line: str) -> None:
    """Overwrite the progress line on stderr (padded: a shorter line hides the longer one before it)."""
    sys.stderr.write("\r" + line.ljust(80))
    sys.stderr.flush()


@dataclass(frozen=True)
class CompileStats:
    """What EngineConfig `compile` did in one engine (`LLMEngine.compile_stats`)."""

    requested: bool
    compiled: bool
    compile_s: float = 0.0
    error: str | None = None
    num_compiled_steps: int = 0
    num_eager_fallbacks: int = 0
    num_compiled_mtp_passes: int = 0
    num_compiled_prefill_steps: int = 0


class CompiledDecodeForward:
    """The compiled uniform-decode forward of one `ModelRunner` (see the module docstring)."""

    def __init__(
        self, runner, max_num_reqs: int, query_lens: tuple[int, ...] = (1,), max_num_columns: int = 1
    ) -> None:
        self.runner = runner
        self.buckets = batch_size_buckets(max_num_reqs)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.num_compiled_steps = 0
        self.num_eager_fallbacks = 0
        self.num_compiled_mtp_passes = 0
        cfg = runner.config
        self._num_heads, self._dn, self._dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        cuda = self._cuda = runner.device.type == "cuda"
        # CPU: a C++ wrapper calls the kernels (no Python per op: decode at small batch is dispatch-bound).
        options = (
            {"mode": "reduce-overhead", "dynamic": False}
            if cuda
            else {"dynamic": True, "options": {"cpp_wrapper": True}}
        )
        # CPU: pad to >= 2 rows and columns, so that one dynamic-shape graph serves every bucket.
        self._min_rows, self._min_columns = (1, max_num_columns) if cuda else (2, 2)
        stack_dense_moe_weights(runner.model)  # before tracing: the graphs read the stacked weights
        self._graphs: dict[int, Callable] = {
            q: torch.compile(self._forward_fn(q), fullgraph=True, **options) for q in self.query_lens
        }
        # The first MTP layer over a uniform step's batch (speculative decoding: q = k + 1 only).
        self._mtp_graphs: dict[int, Callable] = {
            q: torch.compile(self._mtp_forward_fn(q), fullgraph=True, **options)
            for q in self.query_lens
            if q > 1 and runner.model.mtp_layers
        }
        self._ready = False

    @staticmethod
    def supported(runner) -> str | None:
        """None when the compiled forward can run `runner`'s model, else why not."""
        if runner.kv_pools is not None:
            return "kv_precision (KV blocks in several dtypes)"
        if runner.kv_cache_dtype != "auto":
            return "kv_cache_dtype int8 (the compiled attention reads a float cache)"
        for layer in [*runner.model.main_layers, *runner.model.mtp_layers]:
            mlp = layer.mlp
            if isinstance(mlp, DeepseekV3MoE) and not isinstance(mlp.dispatcher, LocalDispatcher):
                return "an MoE layer with a non-local expert dispatcher (expert parallelism)"
        return None

    def _attention(self, layer, block_tables: torch.Tensor, context_lens: torch.Tensor, num_queries: int):
        """`layer`'s attention as the graphs run it: absorbed MLA over the paged cache, then o_proj."""
        attn, cache = layer.self_attn, self.runner.kv_caches[layer.layer_idx]
        w_uk, w_uv = split_kv_b_weight(attn.kv_b_proj.weight, self._num_heads, self._dn, self._dv)
        scale = self.runner.config.softmax_scale

        def attention(q_nope, q_pe, latent_kv):
            out = mla_decode_attention(
                q_nope, q_pe, latent_kv.to(cache.dtype), cache, block_tables, context_lens,
                w_uk, w_uv, scale, num_queries,
            )  # fmt: skip
            return attn.o_proj(out.reshape(out.shape[0], -1))

        return attention

    def _mtp_forward_fn(self, num_queries: int) -> Callable:
        model = self.runner.model
        layer = model.mtp_layers[0]

        def forward(
            input_ids: torch.Tensor,
            prev_hidden: torch.Tensor,
            positions: torch.Tensor,
            block_tables: torch.Tensor,
            context_lens: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = model.model.rope(positions)
            hidden = layer.combine_inputs(model.model.embed_tokens(input_ids), prev_hidden)
            attention = self._attention(layer, block_tables, context_lens, num_queries)
            mlp = layer.mlp.forward_dense if isinstance(layer.mlp, DeepseekV3MoE) else None
            hidden, latent_kv = layer.block(hidden, cos, sin, attention, mlp=mlp)
            return layer.shared_head.norm(hidden), latent_kv

        return forward

    def _forward_fn(self, num_queries: int) -> Callable:
        model = self.runner.model

        def forward(
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            block_tables: torch.Tensor,
            context_lens: torch.Tensor,
        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
            cos, sin = model.model.rope(positions)
            hidden = model.model.embed_tokens(input_ids)
            latents = []
            for layer in model.main_layers:
                attention = self._attention(layer, block_tables, context_lens, num_queries)
                mlp = layer.mlp.forward_dense if isinstance(layer.mlp, DeepseekV3MoE) else None
                hidden, latent_kv = layer.block(hidden, cos, sin, attention, mlp=mlp)
                latents.append(latent_kv)
            return model.model.norm(hidden), latents

        return forward

    def bucket(self, num_reqs: int) -> int | None:
        """The smallest bucket holding `num_reqs` requests, None past the largest."""
        for size in self.buckets:
            if size >= num_reqs:
                return size
        return None

    def accepts(self, num_reqs: int, num_queries: int | None) -> bool:
        """Whether a step of `num_reqs` requests with `num_queries` each (None: not uniform) runs here."""
        return self._ready and num_queries in self._graphs and self.bucket(num_reqs) is not None

    def accepts_mtp(self, num_reqs: int, num_queries: int | None) -> bool:
        """Whether the depth-0 MTP pass over such a step runs here (`mtp`)."""
        return self._ready and num_queries in self._mtp_graphs and self.bucket(num_reqs) is not None

    def warm_up(self, show_progress: bool = True) -> float:
        """Compile the graphs of every (query length, bucket) on dummy inputs (block 0, no context; nothing is
        written).

        Raises:
            Exception: whatever compiling raised (e.g. torch._dynamo.exc.BackendCompilerFailed when
            inductor finds no C++ compiler); the forward then stays unusable (`accepts` is False).
        """
        start = time.perf_counter()
        total = (len(self.query_lens) + len(self._mtp_graphs)) * len(self.buckets)
        done = 0
        device = self.runner.device
        hidden_size, dtype = self.runner.config.hidden_size, self.runner.dtype
        try:
            for q in self.query_lens:
                for size in self.buckets:
                    rows = max(size, self._min_rows)
                    num_columns = self._min_columns if self._cuda else rows * q + 1
                    if show_progress:
                        _progress(
                            f"compiling the decode forward: q={q} batch {size} ({done + 1}/{total}), "
                            f"{time.perf_counter() - start:.0f} s so far"
                        )
                    with torch.inference_mode():
                        ids = torch.zeros(rows * q, dtype=torch.long, device=device)
                        positions = torch.zeros(rows * q, dtype=torch.long, device=device)
                        tables = torch.zeros(rows, num_columns, dtype=torch.long, device=device)
                        lens = torch.zeros(rows, dtype=torch.long, device=device)
                        self._graphs[q](ids, positions, tables, lens)
                        if q in self._mtp_graphs:
                            done += 1
                            prev = torch.zeros(rows * q, hidden_size, dtype=dtype, device=device)
                            self._mtp_graphs[q](ids, prev, positions, tables, lens)
                    done += 1
            if show_progress:
                elapsed_s = time.perf_counter() - start
                _progress(f"compiled the decode forward: {total} buckets in {elapsed_s:.1f} s")
        finally:
            if show_progress:
                sys.stderr.write("\n")
                sys.stderr.flush()
        self._ready = True
        return time.perf_counter() - start

    def _padded(self, batch, num_queries: int, prev_hidden: torch.Tensor | None = None) -> tuple:
        """A uniform step's graph inputs, padded to the bucket by repeating request 0's rows."""
        num_reqs = batch.block_tables.shape[0]
        pad = max(self.bucket(num_reqs), self._min_rows) - num_reqs
        with torch.inference_mode():
            input_ids, positions = batch.input_ids.clone(), batch.positions.clone()
            tables = batch.block_tables.clone(memory_format=torch.contiguous_format)
            context_lens = batch.seq_lens - num_queries
            if prev_hidden is not None:
                prev_hidden = prev_hidden.contiguous()
        if tables.shape[1] < self._min_columns:
            tables = torch.nn.functional.pad(tables, (0, self._min_columns - tables.shape[1]))
        if pad:
            input_ids = torch.cat((input_ids, input_ids[:num_queries].repeat(pad)))
            positions = torch.cat((positions, positions[:num_queries].repeat(pad)))
            tables = torch.cat((tables, tables[:1].expand(pad, -1)))
            context_lens = torch.cat((context_lens, context_lens[:1].expand(pad)))
            if prev_hidden is not None:
                prev_hidden = torch.cat((prev_hidden, prev_hidden[:num_queries].repeat(pad, 1)))
        if prev_hidden is None:
            return input_ids, positions, tables, context_lens
        return input_ids, prev_hidden, positions, tables, context_lens

    def _run(self, graph: Callable, inputs: tuple):
        """The graph's outputs, or None when it would need a graph not compiled at load."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"), torch.inference_mode():
                return graph(*inputs)
        except RuntimeError as e:
            if "Detected recompile" not in str(e):
                raise
            self.num_eager_fallbacks += 1
            return None

    def mtp(self, batch, prev_hidden: torch.Tensor, num_queries: int) -> torch.Tensor | None:
        """The depth-0 MTP pass over a uniform step (`accepts_mtp` said yes; `batch.input_ids` the MTP inputs,
        `prev_hidden` `[num_tokens, hidden_size]` the main forward's output); writes the MTP layer's KV.
        """
        num_tokens = batch.num_tokens
        out = self._run(self._mtp_graphs[num_queries], self._padded(batch, num_queries, prev_hidden))
        if out is None:
            return None
        hidden, latent = out
        runner = self.runner
        idx = runner.model.mtp_layers[0].layer_idx
        write_kv(runner.kv_caches[idx], latent[:num_tokens], batch.slot_mapping, runner.kv_scales[idx])
        self.num_compiled_mtp_passes += 1
        return hidden[:num_tokens]

    def __call__(self, batch, num_queries: int) -> torch.Tensor | None:
        """Run a uniform step (`accepts` said yes); writes its KV."""
        num_tokens = batch.num_tokens
        out = self._run(self._graphs[num_queries], self._padded(batch, num_queries))
        if out is None:
            return None
        hidden, latents = out
        runner = self.runner
        for layer, latent in zip(runner.model.main_layers, latents, strict=True):
            idx = layer.layer_idx
            write_kv(runner.kv_caches[idx], latent[:num_tokens], batch.slot_mapping, runner.kv_scales[idx])
        self.num_compiled_steps += 1
        return hidden[:num_tokens]
