"""The ops of one step on a `PerfModel` instance's slowest rank, grouped as the micro-batch timeline needs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pdcluster.planner import op_costs as oc
from pdcluster.planner.op_costs import OpCost, RankWork
from pdcluster.planner.step_model import StepShape

if TYPE_CHECKING:
    from pdcluster.planner.perf_model import PerfModel

ROUTED = "moe.routed_experts"


def layer_ops(
    model: PerfModel, work: RankWork, t: float, instance_tokens: float, moe: bool, num_sequences: int = 0
) -> list[OpCost]:
    """One decoder layer's ops for `t` rank tokens: MLA, norms, MoE or MLP, 8-bit quantization."""
    cfg, d, par = model.config, model.dtypes, model.parallel
    tp = par.tensor_parallel_size
    ops = oc.attention_projections(cfg, t, d, tp) + oc.attention_core(cfg, work, d, tp)
    ab = oc.dtype_bytes(d.activation)
    ops.append(oc.elementwise("norms_residuals", 10.0 * t * cfg.hidden_size, ab))
    if moe:
        pairs, active, _ = model.moe_load(instance_tokens, num_sequences)
        ops += oc.moe_ops(cfg, t, pairs, active, d, par.moe_tensor_parallel_size, tp)
        inter, routed = cfg.moe_intermediate_size * cfg.n_shared_experts // tp, pairs
    else:
        wb = oc.dtype_bytes(d.weight)
        ops.append(oc.mlp("dense_mlp", t, cfg.hidden_size, cfg.intermediate_size // tp, wb, ab))
        inter, routed = cfg.intermediate_size // tp, 0.0
    if oc.dtype_bytes(d.weight) < ab:
        heads = cfg.num_attention_heads // tp
        inputs = 2 * cfg.hidden_size + (cfg.q_lora_rank or 0) + heads * cfg.v_head_dim + inter
        elements = t * inputs + routed * cfg.moe_intermediate_size // par.moe_tensor_parallel_size
        ops.append(oc.elementwise("quantize", 1.5 * elements, ab))
    return ops


def op_groups(
    model: PerfModel, step: StepShape, work: RankWork, scale: float = 1.0
) -> tuple[list[OpCost], list[OpCost], list[OpCost]]:
    """`(rest, moe_attention, moe_experts)` of `work`, each op counted over the layers it runs in."""
    cfg, d = model.config, model.dtypes
    if work.num_tokens == 0:
        return [], [], []
    ab = oc.dtype_bytes(d.activation)
    h = cfg.hidden_size
    instance_tokens = float(step.num_tokens) * scale
    num_dense = (
        min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
        if cfg.n_routed_experts
        else cfg.num_hidden_layers
    )
    num_moe = cfg.num_hidden_layers - num_dense
    t = work.num_tokens
    seqs = len(step.prefill) + len(step.decode)
    rest = [oc.elementwise("embedding", t * h, ab)]
    if num_dense:
        rest += [op.times(num_dense) for op in layer_ops(model, work, t, instance_tokens, False)]
    moe_attn, moe_exp = [], []
    if num_moe:
        for op in layer_ops(model, work, t, instance_tokens, True, seqs):
            (moe_exp if op.name == ROUTED else moe_attn).append(op.times(num_moe))
    rest.append(oc.elementwise("final_norm", 2.0 * t * h, ab))
    rest.append(oc.lm_head(cfg, work.logit_rows, d))
    rows = work.logit_rows + work.mtp_logit_rows  # softmax, top-k/top-p: float32 logits read 3 times
    rest.append(oc.elementwise("sampling", 6.0 * rows * cfg.vocab_size, ab))
    if work.mtp_tokens:
        mt = work.mtp_tokens
        mtp_work = dataclasses.replace(work, num_tokens=mt)  # the same positions' attention
        rest.append(oc.gemm("mtp.eh_proj", mt, 2 * h, h, oc.dtype_bytes(d.weight), ab))
        rest.append(oc.elementwise("mtp.norms", 4.0 * mt * h, ab))
        moe = cfg.is_moe_layer(cfg.num_hidden_layers)
        mtp_ops = layer_ops(model, mtp_work, mt, mt * instance_tokens / t, moe, seqs)
        rest += [dataclasses.replace(op, name="mtp." + op.name) for op in mtp_ops]
        rest.append(oc.lm_head(cfg, work.mtp_logit_rows, d, name="mtp.lm_head"))
    return rest, moe_attn, moe_exp
