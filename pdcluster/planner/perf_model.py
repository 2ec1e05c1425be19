"""Seconds of one engine step and of one KV handoff from FLOPs and bytes: the planner's performance model.

`PerfModel` implements `planner.step_model.StepTimeModel` for one instance of one pool:

1. The step's work is split over the instance's ranks (`planner.rank_split`): attention and dense layers
   data-parallel over `devices / tensor_parallel_size` ranks (DP attention), heads split over
   `tensor_parallel_size`. A request is never split: prefill chunks go largest first to the least loaded
   rank and the most loaded rank is priced; decode rows are spread evenly, `ceil(rows / dp)` on the
   slowest rank. Routed experts live on `expert_parallel_size` ranks, `(n_routed + redundant) / ep` each;
   the slowest EP rank takes `ep_imbalance` times the mean (token, expert) pairs
   (`planner.comm_costs.statistical_imbalance` when not given).
2. `planner.op_costs` counts each op's FLOPs and bytes on that rank (MLA expanded or absorbed per request
   by the engine's own rule, dense MLP, gate, routed and shared experts, lm_head, the MTP layer).
3. A roofline prices each op: `max(flops / (peak(dtype) x compute factor), bytes / (bandwidth x memory
   factor))` (Williams, Waterman, Patterson, "Roofline", CACM 2009), factors from
   `orchestrator.efficiency` or a calibration written by `pdcluster profile`; plus `op_overhead_s` per op.
4. EP dispatch/combine per MoE layer moves each token's hidden state to its `k` experts and back over the
   link level the EP group spans (`planner.topology_models.link_level`; `planner.comm_costs`, optionally
   once per node with intra-node forwarding); TP attention adds a ring all-reduce of `o_proj`'s output.
   With `microbatch_overlap` (DeepSeek's dual micro-batch overlap, CloudMatrix-Infer's micro-batch
   pipeline) communication hides behind compute: `max(compute, comm)`; else they add up.
5. Host overhead per step is added on top.

`kv_handoff_s` moves the prompt's latent KV (all layers, MTP layers included, in the wire dtype) over
the prefill->decode link, layer by layer behind the prefill compute when `layerwise`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcluster.kernels.mla_cost import expanded_crossover_queries
from pdcluster.models.config import DeepseekV3Config
from pdcluster.orchestrator.efficiency import Efficiency, get_efficiency
from pdcluster.orchestrator.hardware import AcceleratorSpec, get_accelerator
from pdcluster.planner import op_costs as oc
from pdcluster.planner.comm_costs import Link, ep_layer_s, statistical_imbalance
from pdcluster.planner.op_costs import Dtypes, OpCost, RankWork
from pdcluster.planner.rank_split import attention_sums, decode_sums, slowest_rank_chunks
from pdcluster.planner.step_model import StepShape

if TYPE_CHECKING:
    from pdcluster.orchestrator.topology import Topology


@dataclass(frozen=True)
class Parallelism:
    """How one instance is split (the topology pool's fields of the same names)."""

    devices: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0

    def __post_init__(self) -> None:
        for name in ("devices", "tensor_parallel_size", "expert_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"Parallelism.{name} must be >= 1, got {getattr(self, name)}")
        if self.devices % self.tensor_parallel_size or self.devices % self.expert_parallel_size:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} and expert_parallel_size "
                f"{self.expert_parallel_size} must divide devices {self.devices}"
            )

    @property
    def data_parallel_size(self) -> int:
        return self.devices // self.tensor_parallel_size

    @property
    def moe_tensor_parallel_size(self) -> int:
        return self.devices // self.expert_parallel_size


@dataclass(frozen=True)
class StepBreakdown:
    """One step priced: seconds per op name (summed over layers), compute, communication, host, total."""

    op_s: dict[str, float]
    compute_s: float
    comm_s: float
    host_s: float
    total_s: float
    compute_bound_ops: tuple[str, ...] = field(default=())


class PerfModel:
    """The step-time model of one instance (see the module docstring).

    Args:
        config: the model architecture.
        spec: the accelerator catalog entry of one device.
        efficiency: per-op factors (`orchestrator.efficiency.get_efficiency(spec.name)`, or a calibration).
        dtypes: weight / activation / KV cache dtypes.
        parallel: the instance's split.
        ep_link, tp_link: link levels the EP group and the TP group span.
        kv_link: the prefill -> decode link one device sends KV over.
        kv_wire_dtype: dtype of KV on the wire (int8 or a model dtype).
        layerwise_kv: layer-by-layer KV streaming behind prefill compute.
        mtp_in_prefill: run the MTP layer over prompt tokens (the prefill side drafts the first k).
        ep_imbalance: slowest EP rank's load over the mean; None: `statistical_imbalance` per step.
        dispatch_dtype, combine_dtype: dtypes of the EP dispatch and combine messages.
        microbatch_overlap: hide communication behind compute (two micro-batches).
        node_forwarding: `(devices_per_node, intra-node link)` when EP traffic crossing nodes is sent once
            per destination node and forwarded inside it (DeepEP's normal kernels, DeepSeek-V3 report
            section 3.2.2: node-limited routing, IB then NVLink); None: every (token, expert) pair goes
            over `ep_link` (DeepEP's low-latency kernels, pure RDMA).

    Raises:
        ValueError: `ep_imbalance` < 1, more TP ranks than heads, or a dtype the accelerator has no matrix
            peak for in the catalog (e.g. fp8 on an Ascend die).
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        spec: AcceleratorSpec,
        efficiency: Efficiency | None = None,
        *,
        dtypes: Dtypes | None = None,
        parallel: Parallelism | None = None,
        ep_link: Link | None = None,
        tp_link: Link | None = None,
        kv_link: Link | None = None,
        kv_wire_dtype: str | None = None,
        layerwise_kv: bool = True,
        mtp_in_prefill: bool = False,
        ep_imbalance: float | None = None,
        dispatch_dtype: str | None = None,
        combine_dtype: str | None = None,
        microbatch_overlap: bool = False,
        node_forwarding: tuple[int, Link] | None = None,
    ) -> None:
        self.config = config
        self.spec = spec
        self.efficiency = efficiency or get_efficiency(spec.name)
        self.dtypes = dtypes or Dtypes()
        self.parallel = parallel or Parallelism()
        default_link = Link(10e9, 5e-6)
        self.ep_link = ep_link or default_link
        self.tp_link = tp_link or default_link
        self.kv_link = kv_link or default_link
        self.kv_wire_dtype = kv_wire_dtype or self.dtypes.kv
        self.layerwise_kv = layerwise_kv
        self.mtp_in_prefill = mtp_in_prefill and config.num_nextn_predict_layers > 0
        if ep_imbalance is not None and ep_imbalance < 1:
            raise ValueError(f"ep_imbalance must be >= 1 (slowest rank over the mean), got {ep_imbalance}")
        self.ep_imbalance = ep_imbalance
        self.dispatch_dtype = dispatch_dtype or self.dtypes.activation
        self.combine_dtype = combine_dtype or self.dtypes.activation
        self.microbatch_overlap = microbatch_overlap
        self.node_forwarding = node_forwarding
        if self.parallel.tensor_parallel_size > config.num_attention_heads:
            raise ValueError("tensor_parallel_size exceeds num_attention_heads")
        self.num_moe_layers = sum(1 for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
        self.crossover_queries = expanded_crossover_queries(
            config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        )
        self._set_peaks()

    def with_efficiency(self, efficiency: Efficiency) -> PerfModel:
        """The same instance priced with other efficiency factors (a calibration being fitted)."""
        other = PerfModel.__new__(PerfModel)
        other.__dict__.update(self.__dict__)
        other.efficiency = efficiency
        other._set_peaks()
        return other

    def _set_peaks(self) -> None:
        """Peaks times factors, looked up once (ValueError for a dtype the device has no peak for)."""
        spec, eff, d = self.spec, self.efficiency, self.dtypes
        bw = spec.hbm_bytes_per_s
        self._gemm = (spec.matmul_flops_per_s(d.weight) * eff.gemm_compute.value, bw * eff.gemm_memory.value)
        self._attn = (
            spec.matmul_flops_per_s(d.activation) * eff.attention_compute.value,
            bw * eff.attention_memory.value,
        )
        self._mem = (math.inf, bw * eff.memory.value)

    # ---- work split ----------------------------------------------------------------------------------
    def rank_work(self, step: StepShape) -> RankWork:
        """The slowest DP rank's share of `step` (module docstring, item 1)."""
        dp = self.parallel.data_parallel_size
        chunks = slowest_rank_chunks(step.prefill, dp)
        p_acc = attention_sums(((c.num_tokens, c.context_len) for c in chunks), self.crossover_queries)
        p_tokens = sum(c.num_tokens for c in chunks)
        rows = len(step.decode)
        d_acc, d_tokens = decode_sums(step.decode, self.crossover_queries)
        fd = math.ceil(rows / dp) / rows if rows else 0.0
        share = [a + fd * b for a, b in zip(p_acc, d_acc, strict=True)]
        k = step.num_speculative_tokens if self.config.num_nextn_predict_layers else 0
        mtp_tokens = mtp_rows = 0.0
        if k:
            mtp_tokens += fd * (d_tokens + (k - 1) * rows)
            mtp_rows += fd * k * rows
        if self.mtp_in_prefill and chunks:
            mtp_tokens += p_tokens
            mtp_rows += len(chunks)
        return RankWork(
            num_tokens=p_tokens + fd * d_tokens,
            expanded_queries=share[0],
            expanded_keys=share[1],
            expanded_pairs=share[2],
            absorbed_queries=share[3],
            absorbed_keys=share[4],
            absorbed_pairs=share[5],
            logit_rows=len(chunks) + fd * d_tokens,
            mtp_tokens=mtp_tokens,
            mtp_logit_rows=mtp_rows,
        )

    def moe_load(self, instance_tokens: float) -> tuple[float, float, float]:
        """`(routed pairs on the slowest EP rank, its active experts, imbalance)` for `instance_tokens`
        tokens of the whole instance through one MoE layer."""
        cfg, par = self.config, self.parallel
        ep, k = par.expert_parallel_size, cfg.num_experts_per_tok
        mean = instance_tokens * k / ep
        imb = self.ep_imbalance if self.ep_imbalance is not None else statistical_imbalance(mean, ep)
        physical = cfg.n_routed_experts + par.num_redundant_experts
        local = physical / ep
        active = oc.expected_active_experts(local, physical, k, instance_tokens)
        return mean * imb, active, imb

    # ---- ops -----------------------------------------------------------------------------------------
    def _layer_ops(self, work: RankWork, t: float, instance_tokens: float, moe: bool) -> list[OpCost]:
        cfg, d, par = self.config, self.dtypes, self.parallel
        tp = par.tensor_parallel_size
        ops = oc.attention_projections(cfg, t, d, tp) + oc.attention_core(cfg, work, d, tp)
        ops.append(
            oc.elementwise("norms_residuals", 10.0 * t * cfg.hidden_size, oc.dtype_bytes(d.activation))
        )
        if moe:
            pairs, active, _ = self.moe_load(instance_tokens)
            ops += oc.moe_ops(cfg, t, pairs, active, d, par.moe_tensor_parallel_size, tp)
        else:
            wb, ab = oc.dtype_bytes(d.weight), oc.dtype_bytes(d.activation)
            ops.append(oc.mlp("dense_mlp", t, cfg.hidden_size, cfg.intermediate_size // tp, wb, ab))
        return ops

    def ops(self, step: StepShape, work: RankWork | None = None) -> list[OpCost]:
        """Every op of the slowest rank in `step`, each with its `count` (layers it runs in)."""
        cfg, d = self.config, self.dtypes
        work = work or self.rank_work(step)
        if work.num_tokens == 0:
            return []
        ab = oc.dtype_bytes(d.activation)
        h = cfg.hidden_size
        instance_tokens = float(step.num_tokens)
        num_dense = (
            min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
            if cfg.n_routed_experts
            else cfg.num_hidden_layers
        )
        num_moe = cfg.num_hidden_layers - num_dense
        t = work.num_tokens
        ops = [oc.elementwise("embedding", t * h, ab)]
        if num_dense:
            ops += [op.times(num_dense) for op in self._layer_ops(work, t, instance_tokens, moe=False)]
        if num_moe:
            ops += [op.times(num_moe) for op in self._layer_ops(work, t, instance_tokens, moe=True)]
        ops.append(oc.elementwise("final_norm", 2.0 * t * h, ab))
        ops.append(oc.lm_head(cfg, work.logit_rows, d))
        if work.mtp_tokens:
            mt = work.mtp_tokens
            mtp_work = dataclasses.replace(work, num_tokens=mt)  # the same positions' attention
            ops.append(oc.gemm("mtp.eh_proj", mt, 2 * h, h, oc.dtype_bytes(d.weight), ab))
            ops.append(oc.elementwise("mtp.norms", 4.0 * mt * h, ab))
            moe = cfg.is_moe_layer(cfg.num_hidden_layers)
            mtp_instance = mt * instance_tokens / t
            ops += [self._rename(op, "mtp.") for op in self._layer_ops(mtp_work, mt, mtp_instance, moe)]
            ops.append(oc.lm_head(cfg, work.mtp_logit_rows, d, name="mtp.lm_head"))
        return ops

    @staticmethod
    def _rename(op: OpCost, prefix: str) -> OpCost:
        return OpCost(
            prefix + op.name, op.kind, op.flops, op.weight_bytes, op.activation_bytes, op.kv_bytes, op.count
        )

    # ---- pricing -------------------------------------------------------------------------------------
    def op_time_s(self, op: OpCost) -> tuple[float, bool]:
        """`(seconds of one run of op, compute-bound?)` on the roofline."""
        peak, bw = self._gemm if op.kind == "gemm" else self._attn if op.kind == "attention" else self._mem
        compute_s = op.flops / peak
        memory_s = op.bytes / bw
        return max(compute_s, memory_s), compute_s > memory_s

    def comm_time_s(self, step: StepShape, work: RankWork | None = None) -> float:
        """EP dispatch + combine over all MoE layers (MTP's included) and TP all-reduces, slowest rank."""
        cfg, par = self.config, self.parallel
        work = work or self.rank_work(step)
        if work.num_tokens == 0:
            return 0.0
        total = 0.0
        h = cfg.hidden_size
        ep, tp = par.expert_parallel_size, par.tensor_parallel_size
        num_moe = self.num_moe_layers
        layer_tokens = [(work.num_tokens, float(step.num_tokens), num_moe)]
        if work.mtp_tokens and cfg.is_moe_layer(cfg.num_hidden_layers):
            layer_tokens.append((work.mtp_tokens, work.mtp_tokens * step.num_tokens / work.num_tokens, 1))
        if ep > 1:
            for t_rank, t_inst, layers in layer_tokens:
                total += layers * self._ep_layer_s(t_rank, t_inst)
        if tp > 1:
            ab = oc.dtype_bytes(self.dtypes.activation)
            bw = self.tp_link.bandwidth_bytes_per_s * self.efficiency.link.value
            layers = cfg.num_hidden_layers + (1 if work.mtp_tokens else 0)
            ring = 2 * (tp - 1) / tp * work.num_tokens * h * ab
            total += layers * (ring / bw + 2 * (tp - 1) * self.tp_link.latency_s)
        return total

    def _ep_layer_s(self, t_rank: float, t_inst: float) -> float:
        """Dispatch + combine of one MoE layer on the slowest rank (`t_rank` own tokens, `t_inst` in the
        instance): `planner.comm_costs.ep_layer_s`."""
        pairs, _, imb = self.moe_load(t_inst)
        return ep_layer_s(
            self.config,
            self.parallel.expert_parallel_size,
            t_rank,
            pairs,
            imb,
            oc.dtype_bytes(self.dispatch_dtype) + oc.dtype_bytes(self.combine_dtype),
            self.ep_link,
            self.efficiency.link.value,
            self.node_forwarding,
        )

    def breakdown(self, step: StepShape) -> StepBreakdown:
        """`step` priced op by op (seconds summed over the layers each op runs in)."""
        op_s: dict[str, float] = {}
        bound = []
        n_ops = 0
        work = self.rank_work(step)
        for op in self.ops(step, work):
            s, is_compute = self.op_time_s(op)
            op_s[op.name] = op_s.get(op.name, 0.0) + s * op.count
            n_ops += op.count
            if is_compute:
                bound.append(op.name)
        if not op_s:
            return StepBreakdown({}, 0.0, 0.0, 0.0, 0.0)
        compute = sum(op_s.values()) + n_ops * self.efficiency.op_overhead_s.value
        comm = self.comm_time_s(step, work)
        device = max(compute, comm) if self.microbatch_overlap else compute + comm
        host = self.efficiency.host_overhead_s.value
        return StepBreakdown(op_s, compute, comm, host, device + host, tuple(bound))

    def step_time_s(self, step: StepShape) -> float:
        """Wall seconds of `step` on this instance (slowest rank); 0 for an empty step. The same sum as
        `breakdown(step).total_s`, without the per-op record."""
        work = self.rank_work(step)
        ops = self.ops(step, work)
        if not ops:
            return 0.0
        compute = n_ops = 0.0
        for op in ops:
            compute += self.op_time_s(op)[0] * op.count
            n_ops += op.count
        compute += n_ops * self.efficiency.op_overhead_s.value
        comm = self.comm_time_s(step, work)
        device = max(compute, comm) if self.microbatch_overlap else compute + comm
        return device + self.efficiency.host_overhead_s.value

    # ---- KV handoff ----------------------------------------------------------------------------------
    def kv_bytes_per_layer(self, num_prompt_tokens: int) -> float:
        """Wire bytes of one layer of a prompt's latent KV."""
        return num_prompt_tokens * oc.kv_bytes_per_token_per_layer(self.config, self.kv_wire_dtype)

    @property
    def kv_layers(self) -> int:
        """Layers whose KV moves: the main layers and the MTP layers (the engine caches both)."""
        return self.config.num_hidden_layers + self.config.num_nextn_predict_layers

    def kv_handoff_s(self, num_prompt_tokens: int, prefill_compute_s: float) -> float:
        """Seconds the KV handoff adds after the prefill compute (`StepTimeModel.kv_handoff_s`).

        One layer moves in `t = bytes_layer / (bandwidth x kv_link factor)`. Layer-wise, layer i can start
        when its compute is done (`c = prefill_compute_s / layers` each), so the last layer lands
        `max(t, L t - (L - 1) c)` after the compute ends; otherwise all `L t` follow it. Plus the link's
        latency and the fixed per-handoff cost.
        """
        if num_prompt_tokens <= 0:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        layers = self.kv_layers
        bw = self.kv_link.bandwidth_bytes_per_s * self.efficiency.kv_link.value
        t = self.kv_bytes_per_layer(num_prompt_tokens) / bw
        c = max(prefill_compute_s, 0.0) / layers
        transfer = max(t, layers * t - (layers - 1) * c) if self.layerwise_kv else layers * t
        return transfer + self.kv_link.latency_s + self.efficiency.handoff_overhead_s.value


def accelerator_model(
    config: DeepseekV3Config, accelerator: str, efficiency: Efficiency | None = None, **kwargs
) -> PerfModel:
    """`PerfModel(config, get_accelerator(accelerator), efficiency, **kwargs)`."""
    return PerfModel(config, get_accelerator(accelerator), efficiency, **kwargs)


# ---- from a topology (planner.topology_models) -------------------------------------------------------
def perf_model_for(topology: Topology, role: str, **kwargs) -> PerfModel:
    """The `PerfModel` of one instance of pool `role` of `topology`: `planner.topology_models.perf_model_for`
    (arguments and errors there)."""
    from pdcluster.planner.topology_models import perf_model_for as build

    return build(topology, role, **kwargs)
