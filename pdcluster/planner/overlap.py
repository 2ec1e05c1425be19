"""Two-micro-batch overlap as a timeline (DeepSeek Day 6 inference overview, "dual micro-batch overlap";
CloudMatrix-Infer, arXiv:2506.12708).

Per MoE layer each half runs attention, dispatch, moe, combine; one compute and one communication stream,
so a half's communication hides only behind the other half's compute.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeline:
    """`makespan_s` of the layers and `serial_s` of the same ops back to back."""

    makespan_s: float
    serial_s: float

    @property
    def hidden_comm_s(self) -> float:
        return self.serial_s - self.makespan_s


def layer_timeline(
    num_layers: int, attention_s: float, moe_s: float, dispatch_s: float, combine_s: float
) -> Timeline:
    """The timeline of `num_layers` identical MoE layers; durations are one half's, in seconds. Raises
    ValueError for a negative duration or layer count."""
    if num_layers < 0 or min(attention_s, moe_s, dispatch_s, combine_s) < 0:
        raise ValueError("layer_timeline: durations and num_layers must be >= 0")
    serial = 2.0 * num_layers * (attention_s + moe_s + dispatch_s + combine_s)
    compute_free = comm_free = 0.0
    ready = [0.0, 0.0]
    for _ in range(num_layers):
        attn_done = [0.0, 0.0]
        for h in (0, 1):
            compute_free = max(compute_free, ready[h]) + attention_s
            attn_done[h] = compute_free
        disp_done = [0.0, 0.0]
        for h in (0, 1):
            comm_free = max(comm_free, attn_done[h]) + dispatch_s
            disp_done[h] = comm_free
        moe_done = [0.0, 0.0]
        for h in (0, 1):
            compute_free = max(compute_free, disp_done[h]) + moe_s
            moe_done[h] = compute_free
        for h in (0, 1):
            comm_free = max(comm_free, moe_done[h]) + combine_s
            ready[h] = comm_free
    return Timeline(max(ready[0], ready[1], compute_free), serial)


def overlapped_s(
    num_layers: int, attention_s: float, moe_s: float, dispatch_s: float, combine_s: float
) -> float:
    """`layer_timeline(...).makespan_s` in constant time: the schedule repeats from the second layer on."""
    if num_layers <= 3:
        return layer_timeline(num_layers, attention_s, moe_s, dispatch_s, combine_s).makespan_s
    two = layer_timeline(2, attention_s, moe_s, dispatch_s, combine_s).makespan_s
    three = layer_timeline(3, attention_s, moe_s, dispatch_s, combine_s).makespan_s
    return three + (num_layers - 3) * (three - two)
