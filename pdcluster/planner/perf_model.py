"""Seconds of one engine step and of one KV handoff from FLOPs and bytes: the planner's performance model.

Each op of the slowest DP/EP rank (`rank_split`, `imbalance`, `op_costs`) is priced on the roofline
`max(flops / (peak x compute fraction), bytes / (bandwidth x memory fraction))` (Williams et al.,
"Roofline", CACM 2009), plus EP communication (`comm_costs`, `overlap`), launch and host time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcluster.config.hardware import AcceleratorSpec, get_accelerator
from pdcluster.config.schema import InstanceSplit
from pdcluster.kernels.mla_cost import expanded_crossover_queries
from pdcluster.models.config import DeepseekV3Config
from pdcluster.planner import op_costs as oc
from pdcluster.planner.comm_costs import Link, ep_layer_s, statistical_imbalance
from pdcluster.planner.efficiency import Efficiency, get_efficiency
from pdcluster.planner.imbalance import dp_max_rank_kv_factor, eplb_imbalance
from pdcluster.planner.kernel_tables import KernelTables, tables_for
from pdcluster.planner.op_costs import Dtypes, OpCost, RankWork
from pdcluster.planner.rank_split import attention_sums, decode_sums, slowest_rank_chunks
from pdcluster.planner.step_model import StepShape
from pdcluster.planner.step_ops import op_groups
from pdcluster.planner.step_pricing import StepBreakdown, gemm_time_s, price_step

if TYPE_CHECKING:
    from pdcluster.config import Topology


@dataclass(frozen=True)
class Parallelism(InstanceSplit):
    """How one instance is split (the pool's fields of the same names; `devices`: devices_per_instance)."""

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
    def devices_per_instance(self) -> int:
        return self.devices


class PerfModel:
    """The step-time model (`StepTimeModel`) of one instance of one pool.

    microbatch_overlap: two micro-batches where faster (True) or at every step ("always").
    ep_imbalance: slowest EP rank's load over the mean (None: EPLB placement x token noise). node_forwarding:
    (devices_per_node, intra-node link) for DeepEP-style forwarding. kernel_tables: "catalog" (the device's),
    a table set, or None (scalar factors only). Raises ValueError for ep_imbalance < 1, more TP ranks than
    heads, or a dtype with no matrix peak in the catalog.
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
        microbatch_overlap: bool | str = False,
        node_forwarding: tuple[int, Link] | None = None,
        kernel_tables: KernelTables | str | None = "catalog",
    ) -> None:
        self.config = config
        self.spec = spec
        if kernel_tables == "catalog":
            kernel_tables = tables_for(spec.name)
        self.tables = kernel_tables
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
        self.ep_imbalance_scale = 1.0  # a shrunk placement's imbalance over EPLB's (`shrunk`)
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
        """The same instance priced with other efficiency factors."""
        other = PerfModel.__new__(PerfModel)
        other.__dict__.update(self.__dict__)
        other.efficiency = efficiency
        other._set_peaks()
        return other

    def shrunk(self, parallel: Parallelism, ep_imbalance_scale: float) -> PerfModel:
        """The same instance on `parallel` (fewer ranks after a loss), its EP imbalance times
        `ep_imbalance_scale` (>= 1: the re-placed experts over EPLB's own placement, `planner.rank_loss`)."""
        if not ep_imbalance_scale >= 1:
            raise ValueError(f"ep_imbalance_scale must be >= 1, got {ep_imbalance_scale}")
        other = PerfModel.__new__(PerfModel)
        other.__dict__.update(self.__dict__)
        other.parallel, other.ep_imbalance_scale = parallel, ep_imbalance_scale
        return other

    def _set_peaks(self) -> None:
        """Peaks times factors, looked up once."""
        spec, eff, d = self.spec, self.efficiency, self.dtypes
        bw = spec.hbm_bytes_per_s
        self._peaks = (spec.matmul_flops_per_s(d.weight), spec.matmul_flops_per_s(d.activation), bw)
        self._gemm = (self._peaks[0] * eff.gemm_compute.value, bw * eff.gemm_memory.value)
        self._attn = (self._peaks[1] * eff.attention_compute.value, bw * eff.attention_memory.value)
        self._mem = (math.inf, bw * eff.memory.value)

    def rank_work(self, step: StepShape) -> RankWork:
        """The slowest DP rank's share of `step`."""
        dp = self.parallel.attention_data_parallel_size
        chunks = slowest_rank_chunks(step.prefill, dp)
        p_acc = attention_sums(((c.num_tokens, c.context_len) for c in chunks), self.crossover_queries)
        p_tokens = sum(c.num_tokens for c in chunks)
        rows = len(step.decode)
        d_acc, d_tokens = decode_sums(step.decode, self.crossover_queries)
        fd = math.ceil(rows / dp) / rows if rows else 0.0
        if rows > dp > 1:  # the rank holding the most KV: keys and pairs scale with it
            kv_sq = sum(r.context_len * r.context_len for r in step.decode)
            kv = dp_max_rank_kv_factor(rows, dp, sum(r.context_len for r in step.decode), kv_sq)
            for i in (1, 2, 4, 5):
                d_acc[i] *= kv
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

    def moe_load(self, instance_tokens: float, num_sequences: int = 0) -> tuple[float, float, float]:
        """`(routed pairs on the slowest EP rank, its active experts, imbalance)` for one MoE layer."""
        cfg, par = self.config, self.parallel
        ep, k = par.expert_parallel_size, cfg.num_experts_per_tok
        mean = instance_tokens * k / ep
        physical = cfg.n_routed_experts + par.num_redundant_experts
        imb = self.ep_imbalance
        if imb is None and ep > 1:
            eff, nodes = self.efficiency, max(1, ep // self.node_forwarding[0]) if self.node_forwarding else 1
            bucket = 2 ** round(math.log2(num_sequences)) if num_sequences > 0 else 0  # cached per bucket
            placed = eplb_imbalance(
                cfg.n_routed_experts, physical, max(cfg.n_group, 1), nodes, ep,
                eff.popularity_sigma.value, eff.routing_sigma.value, bucket,
            )  # fmt: skip
            imb = placed * statistical_imbalance(mean, ep)
        imb = (imb or 1.0) * self.ep_imbalance_scale
        local = physical / ep
        active = oc.expected_active_experts(local, physical, k, instance_tokens)
        return mean * imb, active, imb

    def ops(self, step: StepShape, work: RankWork | None = None) -> list[OpCost]:
        """Every op of the slowest rank in `step`, each with its `count` (layers it runs in)."""
        return [op for group in op_groups(self, step, work or self.rank_work(step)) for op in group]

    def op_time_s(self, op: OpCost, layout: str = "dense", prefill: bool = False) -> tuple[float, bool]:
        """`(seconds of one run of op, compute-bound?)` on the roofline."""
        tables = self.tables
        eff = self.efficiency
        derate = (eff.prefill_serving_fraction if prefill else eff.serving_fraction).value if tables else 1.0
        if tables is not None and op.kind == "gemm" and op.gemms:
            seconds, bound = gemm_time_s(tables, layout, op, self._peaks[0], self._peaks[2])
            return seconds / derate, bound
        if tables is not None and op.kind == "attention":
            att = tables.attention
            if op.seq_len:
                peak = self._peaks[1] * att.prefill_compute_fraction(op.seq_len)
            else:
                peak = self._peaks[1] * att.decode_compute_fraction
            bw = self._peaks[2] * att.memory_fraction
        else:
            peak, bw = (
                self._gemm if op.kind == "gemm" else self._attn if op.kind == "attention" else self._mem
            )
        compute_s = op.flops / peak
        memory_s = op.bytes / bw
        return max(compute_s, memory_s) / derate, compute_s > memory_s

    def comm_time_s(self, step: StepShape, work: RankWork | None = None) -> float:
        """EP dispatch + combine over all MoE layers and TP all-reduces, slowest rank, in seconds."""
        work = work or self.rank_work(step)
        if work.num_tokens == 0:
            return 0.0
        seqs = len(step.prefill) + len(step.decode)
        dispatch, combine = self._ep_layer_s(work.num_tokens, float(step.num_tokens), not step.prefill, seqs)
        return self.num_moe_layers * (dispatch + combine) + self._other_comm_s(step, work)

    def _other_comm_s(self, step: StepShape, work: RankWork) -> float:
        """The MTP layer's EP traffic and the TP all-reduces."""
        cfg, par = self.config, self.parallel
        total = 0.0
        if work.mtp_tokens and cfg.is_moe_layer(cfg.num_hidden_layers) and par.expert_parallel_size > 1:
            inst = work.mtp_tokens * step.num_tokens / work.num_tokens
            seqs = len(step.prefill) + len(step.decode)
            total += sum(self._ep_layer_s(work.mtp_tokens, inst, not step.prefill, seqs))
        tp = par.tensor_parallel_size
        if tp > 1:
            ab = oc.dtype_bytes(self.dtypes.activation)
            bw = self.tp_link.bandwidth_bytes_per_s * self.efficiency.link.value
            layers = cfg.num_hidden_layers + (1 if work.mtp_tokens else 0)
            ring = 2 * (tp - 1) / tp * work.num_tokens * cfg.hidden_size * ab
            total += layers * (ring / bw + 2 * (tp - 1) * self.tp_link.latency_s)
        return total

    def _ep_layer_s(
        self, t_rank: float, t_inst: float, decode_only: bool, num_sequences: int = 0
    ) -> tuple[float, float]:
        """`(dispatch, combine)` seconds of one MoE layer on the slowest rank."""
        ep = self.parallel.expert_parallel_size
        if ep <= 1:
            return 0.0, 0.0
        pairs, _, imb = self.moe_load(t_inst, num_sequences)
        table = None
        if self.tables is not None:
            table = self.tables.ep_decode if decode_only else self.tables.ep_prefill
        sizes = (oc.dtype_bytes(self.dispatch_dtype), oc.dtype_bytes(self.combine_dtype))
        if table is None:  # one link model for both, latencies once: split by bytes
            total = ep_layer_s(
                self.config,
                ep,
                t_rank,
                pairs,
                imb,
                sum(sizes),
                self.ep_link,
                self.efficiency.link.value,
                self.node_forwarding,
            )
            return total * sizes[0] / sum(sizes), total * sizes[1] / sum(sizes)
        out = []
        for nbytes, bandwidth, floor in zip(
            sizes, table.bandwidth(ep), table.latency_floor_s(ep), strict=True
        ):
            link = Link(bandwidth, 0.0, self.ep_link.level)
            moved = ep_layer_s(self.config, ep, t_rank, pairs, imb, nbytes, link, 1.0, self.node_forwarding)
            out.append(max(floor, moved))
        return out[0], out[1]

    def breakdown(self, step: StepShape) -> StepBreakdown:
        """`step` priced op by op (seconds summed over the layers each op runs in)."""
        return price_step(self, step, record=True)

    def step_time_s(self, step: StepShape) -> float:
        """Wall seconds of `step` on this instance (slowest rank); 0 for an empty step."""
        return price_step(self, step, record=False).total_s

    def first_token_s(self, step: StepShape) -> float:
        """Seconds into `step` when its prompts' first tokens are sampled: the step less the prefill MTP
        pass, which runs after the sampling (`engine.remote_prefill.export_callbacks`)."""
        if not (self.mtp_in_prefill and step.prefill):
            return self.step_time_s(step)
        other = PerfModel.__new__(PerfModel)
        other.__dict__.update(self.__dict__)
        other.mtp_in_prefill = False
        return other.step_time_s(step)

    def kv_bytes_per_layer(self, num_prompt_tokens: int) -> float:
        """Wire bytes of one layer of a prompt's latent KV."""
        return num_prompt_tokens * oc.kv_bytes_per_token_per_layer(self.config, self.kv_wire_dtype)

    @property
    def kv_layers(self) -> int:
        """Layers whose KV moves: the main layers and the MTP layers."""
        return self.config.num_hidden_layers + self.config.num_nextn_predict_layers

    def kv_handoff_s(self, num_prompt_tokens: int, prefill_compute_s: float) -> float:
        """Seconds the KV handoff adds after the prefill compute: per layer `t = bytes / bandwidth`,
        `c = compute / L`; layer-wise `max(t, L t - (L - 1) c)`, else `L t`; plus latency and
        handoff overhead."""
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


def perf_model_for(topology: Topology, role: str, **kwargs) -> PerfModel:
    """The `PerfModel` of one instance of pool `role` (see `planner.topology_models.perf_model_for`)."""
    from pdcluster.planner.topology_models import perf_model_for as build

    return build(topology, role, **kwargs)
