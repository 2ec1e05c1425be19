"""Output quality of a serving configuration against the full-precision reference (`pdcluster accuracy`).

Both run the engine's paged path (`ModelRunner`): the reference with float32 weights and a float32 KV
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.kv_precision import LayerDtypes
from pdcluster.engine.model_runner import ModelRunner, build_model_input
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM

REPETITION_NGRAM = 4
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class BandMetrics:
    """Metrics of one band; `reference_*` are the same measures of the reference, None where not measured."""

    length: int
    kv_dtypes: str
    top1_agreement: float
    mean_kl: float
    mtp_acceptance: float | None
    reference_mtp_acceptance: float | None
    repetition_rate: float | None = None
    reference_repetition_rate: float | None = None


@torch.no_grad()
def emulate_weight_dtype_(model: DeepseekV3ForCausalLM, weight_dtype: str) -> None:
    """Round-trip every GEMM weight (`nn.Linear` but `lm_head`) through `weight_dtype`, in place.

    `int8`: symmetric per output channel (`absmax / 127`); `fp8`: float8_e4m3fn with a per-output-channel
    """
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module is model.lm_head:
            continue
        w = module.weight.data.float()
        absmax = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        if weight_dtype == "int8":
            scale = absmax / 127
            q = (w / scale).round().clamp(-127, 127) * scale
        elif weight_dtype == "fp8":
            scale = absmax / FP8_E4M3_MAX
            q = (w / scale).to(torch.float8_e4m3fn).float() * scale
        elif weight_dtype in ("float32", "bfloat16", "float16"):
            q = w.to(getattr(torch, weight_dtype)).float()
        else:
            raise ValueError(f"cannot emulate weight dtype {weight_dtype!r}")
        module.weight.data.copy_(q.to(module.weight.dtype))


def paged_runner(
    model: DeepseekV3ForCausalLM, layer_dtypes: LayerDtypes, num_blocks: int, block_size: int
) -> ModelRunner:
    """A `ModelRunner` whose layer `i` caches in `layer_dtypes[i]` (int8 with per-token scales)."""
    runner = ModelRunner(model, num_blocks, block_size)
    if len(layer_dtypes) != len(runner.kv_caches):
        raise ValueError(f"{len(layer_dtypes)} layer dtypes for {len(runner.kv_caches)} cached layers")
    shape = runner.kv_caches[0].shape
    runner.kv_caches = [torch.zeros(shape, dtype=d, device=runner.device) for d in layer_dtypes]
    runner.kv_scales = [
        torch.zeros(shape[:2], dtype=torch.float32, device=runner.device) if d == torch.int8 else None
        for d in layer_dtypes
    ]
    return runner


def stream_windows(stream: list[int], width: int, num_windows: int) -> torch.Tensor:
    """`[num_windows, width]` int64: evenly spaced, non-overlapping windows of a token stream.
    Raises ValueError: the stream holds fewer than `num_windows` windows of `width` tokens."""
    available = len(stream) // width
    if available < num_windows:
        raise ValueError(f"held-out text has {available} windows of {width} tokens, asked for {num_windows}")
    data = torch.tensor(stream[: available * width], dtype=torch.long).view(available, width)
    return data[:: available // num_windows][:num_windows].clone()


def _tables(batch: int, length: int, block_size: int) -> list[list[int]]:
    per = -(-length // block_size)
    return [list(range(b * per, (b + 1) * per)) for b in range(batch)]


@torch.inference_mode()
def teacher_forced_logits(
    model: DeepseekV3ForCausalLM, layer_dtypes: LayerDtypes, windows: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Main and MTP (depth 0) logits of `windows [B, L + 2]` int64 through the paged cache.

    Returns `(logits [B, L, vocab] float32 for token i+1, mtp_logits [B, L, vocab] float32 for token i+2
    """
    batch, width = windows.shape
    length = width - 2
    tables = _tables(batch, length, block_size)
    runner = paged_runner(model, layer_dtypes, batch * len(tables[0]), block_size)
    inputs = build_model_input(windows[:, :length].tolist(), [0] * batch, tables, block_size, runner.device)
    hidden = runner.forward(inputs)  # [B * L, hidden]
    logits = runner.compute_logits(hidden).view(batch, length, -1)
    if not model.mtp_layers:
        return logits, None
    nexts = build_model_input(
        windows[:, 1 : length + 1].tolist(), [0] * batch, tables, block_size, runner.device
    )
    mtp_hidden = runner.mtp_forward(nexts, hidden)
    return logits, runner.compute_logits(mtp_hidden).view(batch, length, -1)


def _mtp_acceptance(logits: torch.Tensor, mtp_logits: torch.Tensor | None) -> float | None:
    if mtp_logits is None:
        return None
    drafts = mtp_logits[:, :-1].argmax(-1)
    return (drafts == logits[:, 1:].argmax(-1)).float().mean().item()


def compare_teacher_forced(
    reference: DeepseekV3ForCausalLM,
    config_model: DeepseekV3ForCausalLM,
    config_dtypes: LayerDtypes,
    windows: torch.Tensor,
    block_size: int,
    batch_size: int = 4,
) -> dict[str, float | None]:
    """Teacher-forced `top1_agreement`, `mean_kl`, `mtp_acceptance` and `reference_mtp_acceptance` of
    `config_model` with `config_dtypes` against `reference` (float32 KV) on `windows [N, L + 2]`; when
    `config_model is reference` with float32 KV everywhere, the configuration is the reference (run once).
    """
    num_layers = len(config_dtypes)
    ref_dtypes = (torch.float32,) * num_layers
    agree = kl = num = 0.0
    accept: list[float] = []
    ref_accept: list[float] = []
    same = config_model is reference and tuple(config_dtypes) == ref_dtypes
    for start in range(0, windows.shape[0], batch_size):
        chunk = windows[start : start + batch_size]
        ref_logits, ref_mtp = teacher_forced_logits(reference, ref_dtypes, chunk, block_size)
        if same:
            logits, mtp = ref_logits, ref_mtp
        else:
            logits, mtp = teacher_forced_logits(config_model, config_dtypes, chunk, block_size)
        agree += (ref_logits.argmax(-1) == logits.argmax(-1)).sum().item()
        ref_logp, logp = F.log_softmax(ref_logits, -1), F.log_softmax(logits, -1)
        kl += (ref_logp.exp() * (ref_logp - logp)).sum(-1).sum().item()
        num += ref_logits.shape[0] * ref_logits.shape[1]
        for out, lg, m in ((accept, logits, mtp), (ref_accept, ref_logits, ref_mtp)):
            rate = _mtp_acceptance(lg, m)
            if rate is not None:
                out.append(rate)
    return {
        "top1_agreement": agree / num,
        "mean_kl": kl / num,
        "mtp_acceptance": sum(accept) / len(accept) if accept else None,
        "reference_mtp_acceptance": sum(ref_accept) / len(ref_accept) if ref_accept else None,
    }


@torch.inference_mode()
def greedy_generate(
    model: DeepseekV3ForCausalLM,
    layer_dtypes: LayerDtypes,
    prompts: list[list[int]],
    num_new_tokens: int,
    block_size: int,
) -> list[list[int]]:
    """Greedy continuations of `num_new_tokens` tokens each (EOS ignored) through the paged cache."""
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    tables = _tables(batch, max(lengths) + num_new_tokens, block_size)
    runner = paged_runner(model, layer_dtypes, batch * len(tables[0]), block_size)
    hidden = runner.forward(build_model_input(prompts, [0] * batch, tables, block_size, runner.device))
    ends = torch.tensor(lengths).cumsum(0) - 1
    nxt = runner.compute_logits(hidden[ends]).argmax(-1).tolist()
    out = [[t] for t in nxt]
    for step in range(1, num_new_tokens):
        positions = [n + step - 1 for n in lengths]
        batch_in = build_model_input([[t] for t in nxt], positions, tables, block_size, runner.device)
        nxt = runner.compute_logits(runner.forward(batch_in)).argmax(-1).tolist()
        for row, t in zip(out, nxt, strict=True):
            row.append(t)
    return out


def repetition_rate(tokens: list[int], n: int = REPETITION_NGRAM) -> float:
    """Fraction of positions whose `n`-gram ending there occurred earlier in `tokens` (0 for short input)."""
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for end in range(n, len(tokens) + 1):
        gram = tuple(tokens[end - n : end])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else 0.0
