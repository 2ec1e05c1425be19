"""The decode forward compiled once, at load, over a fixed set of padded batch-size buckets.

A step is *uniform* when every request runs the same number `q` of query tokens: plain decode (`q = 1`)
or speculative verification of `k` drafts each (`q = k + 1`). Such a step, with at most the largest
bucket's requests, runs the compiled main-model forward: the batch is padded up to the next bucket by
repeating request 0 (its outputs are dropped; its KV writes repeat request 0's, the same values into
the same slots), the main layers run as one graph (`kernels.mla_decode` attention over the cache plus
this step's latents; `DeepseekV3MoE.forward_dense` for MoE layers), and this step's latent KV of every
layer is written into the paged cache after the graph returns. Any other step (a prefill chunk, mixed
query lengths, an `on_layer_kv` hook, a batch past the largest bucket) runs the eager forward. With MTP, the
first MTP pass of such a step (the MTP layer over the same batch, `ModelRunner.mtp_forward` at depth 0) runs
as a graph of its own too (`mtp`), padded the same way (the main forward's hidden states by request 0's
rows); the chained draft depths stay eager.

    CPU:  torch.compile (inductor), shapes dynamic in the batch and the context length, so the buckets
          share one graph per query length: batches and block tables are padded to at least 2 rows and
          2 columns, as torch.compile specializes a size of 1 into a graph of its own.
    CUDA: torch.compile(mode="reduce-overhead"): CUDA graphs captured per bucket (static shapes). Not run
          on this project's machines (no GPU was lent); the switch and the buckets are the same.

Greedy output is the same as the eager forward's up to float rounding (another summation order in
the fused kernels and the dense MoE), which greedy argmax does not see on the bundled model
(tests/engine/test_compiled_forward.py checks token identity for k = 0, 1, 3).
Compilation happens in `warm_up` (the engine calls it at load, printing progress to stderr); after it a
step that would need a new graph runs eagerly instead of compiling (`torch.compiler.set_stance`). When
compiling fails at load (no C++ compiler for inductor, an inductor or dynamo error), the engine logs a
warning naming the error and runs every step eagerly (`LLMEngine`, `CompileStats.error`): same tokens,
slower decode.
"""

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


def _progress(line: str) -> None:
    """Overwrite the progress line on stderr (padded: a shorter line hides the longer one before it)."""
    sys.stderr.write("\r" + line.ljust(80))
    sys.stderr.flush()


@dataclass(frozen=True)
class CompileStats:
    """What EngineConfig `compile` did in one engine (`LLMEngine.compile_stats`).

    Attributes:
        requested: `compile` was on.
        compiled: the compiled forward runs this engine's uniform decode steps (False: every step eager).
        compile_s: seconds compiling took at load (`CompiledDecodeForward.warm_up`), up to the failure when
            it failed; 0.0 when nothing was compiled.
        error: why `compile` was on and nothing runs compiled: what the model or cache lacks
            (`CompiledDecodeForward.supported`), or `ExceptionType: first line of its message` of a failed
            compilation; None otherwise.
        num_compiled_steps: steps that ran the compiled graph.
        num_eager_fallbacks: steps that needed a graph not compiled at load (they ran eagerly).
        num_compiled_mtp_passes: MTP passes (depth 0) that ran the compiled MTP graph.
        num_compiled_prefill_steps: other steps (prefill, mixed) that ran the compiled ragged-batch graph
            (`engine.compiled_prefill`).
    """

    requested: bool
    compiled: bool
    compile_s: float = 0.0
    error: str | None = None
    num_compiled_steps: int = 0
    num_eager_fallbacks: int = 0
    num_compiled_mtp_passes: int = 0
    num_compiled_prefill_steps: int = 0


class CompiledDecodeForward:
    """The compiled uniform-decode forward of one `ModelRunner` (see the module docstring).

    Args:
        runner: the model runner (weights, KV cache).
        max_num_reqs: the largest bucket (the engine's `max_num_seqs`).
        query_lens: the `q` values to compile (1, or k + 1 with speculative decoding).
        max_num_columns: block-table columns of the longest request; on cuda every table is padded to
            it (a CUDA graph has fixed shapes).
    """

    def __init__(
        self, runner, max_num_reqs: int, query_lens: tuple[int, ...] = (1,), max_num_columns: int = 1
    ) -> None:
        self.runner = runner
        self.buckets = batch_size_buckets(max_num_reqs)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.num_compiled_steps = 0  # steps that ran the compiled graph (tests, benchmarks)
        self.num_eager_fallbacks = 0  # uniform steps that needed a graph not compiled at load
        self.num_compiled_mtp_passes = 0  # depth-0 MTP passes that ran the compiled MTP graph
        cfg = runner.config
        self._num_heads, self._dn, self._dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        cuda = self._cuda = runner.device.type == "cuda"
        options = {"mode": "reduce-overhead", "dynamic": False} if cuda else {"dynamic": True}
        # CPU: pad to >= 2 rows and columns, so that one dynamic-shape graph serves every bucket.
        self._min_rows, self._min_columns = (1, max_num_columns) if cuda else (2, 2)
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
        """`layer`'s attention as the graphs run it: absorbed MLA over its paged cache plus this step's
        latents (`kernels.mla_decode`), then the output projection."""
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
        """Compile the graphs of every (query length, bucket) on dummy inputs (block 0, no context;
        nothing is written). Returns the seconds it took; progress lines go to stderr.

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
                    # Sizes that differ (columns from rows and tokens) and distinct tensors: torch.compile
                    # would otherwise assume equal sizes / aliasing that later steps do not have.
                    num_columns = self._min_columns if self._cuda else rows * q + 1
                    if show_progress:  # before the call: the first bucket of each q takes the longest
                        _progress(
                            f"compiling the decode forward: q={q} batch {size} ({done + 1}/{total}), "
                            f"{time.perf_counter() - start:.0f} s so far"
                        )
                    with torch.inference_mode():  # inference tensors, like every step's inputs
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
            if show_progress:  # end the progress line, also before a failure's message
                sys.stderr.write("\n")
                sys.stderr.flush()
        self._ready = True
        return time.perf_counter() - start

    def _padded(self, batch, num_queries: int, prev_hidden: torch.Tensor | None = None) -> tuple:
        """The graph inputs of a uniform step: (input_ids, [prev_hidden,] positions, block tables,
        context lengths), padded to the bucket by repeating request 0's rows."""
        num_reqs = batch.block_tables.shape[0]
        pad = max(self.bucket(num_reqs), self._min_rows) - num_reqs
        # Fresh contiguous inference tensors, like the load-time inputs (the persistent buffers are
        # ordinary tensors, the block table a strided view): the graphs' guards check both.
        with torch.inference_mode():
            input_ids, positions = batch.input_ids.clone(), batch.positions.clone()
            tables = batch.block_tables.clone(memory_format=torch.contiguous_format)
            context_lens = batch.seq_lens - num_queries
            if prev_hidden is not None:
                prev_hidden = prev_hidden.contiguous()
        if tables.shape[1] < self._min_columns:  # extra columns past every context are never read
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
        except RuntimeError as e:  # a shape the load-time compilation did not cover: never compile
            if "Detected recompile" not in str(e):  # per step (torch.compiler.set_stance's message)
                raise
            self.num_eager_fallbacks += 1
            return None

    def mtp(self, batch, prev_hidden: torch.Tensor, num_queries: int) -> torch.Tensor | None:
        """The depth-0 MTP pass over a uniform step (`accepts_mtp` said yes; `batch.input_ids` the MTP
        inputs, `prev_hidden` `[num_tokens, hidden_size]` the main forward's output); writes the MTP
        layer's KV. Returns `shared_head.norm` of its hidden states `[num_tokens, hidden_size]`, or None
        when it would need a graph not compiled at load (the caller runs it eagerly; nothing written)."""
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
        """Run a uniform step (`accepts` said yes); writes its KV. Returns the final hidden states
        `[num_tokens, hidden_size]`, or None when it would need a graph not compiled at load (then
        the caller runs the eager forward; nothing was written)."""
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
