"""Batched token sampling: temperature, top-k, top-p, per-request generators, and log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

Generators = torch.Generator | Sequence[torch.Generator | None] | None
"""A single generator (or None = torch's global one) shared by the batch, or one per row."""


# dtypes numpy's argmax reads straight from a CPU tensor's memory (numpy has no bfloat16)
_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of `x [..., V]`: `[...]` int64, the first index on ties, NaN counting as largest."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_ARGMAX_DTYPES and not x.requires_grad and x.dim():
        return torch.from_numpy(np.asarray(np.argmax(x.numpy(), axis=-1), dtype=np.int64))
    return x.argmax(dim=-1)


def argmax_list(x: torch.Tensor) -> list[int]:
    """`argmax(x).tolist()` of `x [N, V]` (a CPU float tensor: numpy alone, no tensor in between)."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_ARGMAX_DTYPES and not x.requires_grad and x.dim() == 2:
        return np.argmax(x.numpy(), axis=-1).tolist()
    return argmax(x).tolist()


def _per_row(
    value: torch.Tensor | float | int | None, batch: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    if value is None:
        return None
    return torch.as_tensor(value, dtype=dtype, device=device).expand(batch)


def probs_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """softmax(logits / T) restricted to top-k then top-p: `probs [B, V]` float32, 0 outside the kept set.

    logits: `[B, V]` float (computed in float32). temperature: `[B]` float32 or scalar >= 0; 0 gives a
    one-hot at the argmax. top_k: `[B]` int64 or scalar, ties at the k-th value kept; `<= 0`, `>= V` or
    None disables. top_p: `[B]` float32 or scalar in (0, 1]; a token is kept while the mass ranked above
    it is `< top_p`; 1 or None disables.
    Raises ValueError: `logits` not 2-D, a negative temperature, or `top_p` outside (0, 1].
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    batch, vocab_size = logits.shape
    device = logits.device
    logits = logits.float()
    temperature = _per_row(temperature, batch, torch.float32, device)
    if bool((temperature < 0).any()):
        raise ValueError(f"temperature must be >= 0, got {temperature.tolist()}")
    is_greedy = temperature == 0
    scaled = logits / torch.where(is_greedy, 1.0, temperature)[:, None]

    # Each filter runs on the rows it changes only (top_k in [1, V), top_p < 1): the others keep every token.
    top_k = _per_row(top_k, batch, torch.int64, device)
    rows = None if top_k is None else ((top_k > 0) & (top_k < vocab_size)).nonzero()[:, 0]
    if rows is not None and rows.numel():
        sub, k = scaled[rows], top_k[rows]
        kth_largest = sub.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])  # [R, 1]
        scaled[rows] = sub.masked_fill(sub < kth_largest, float("-inf"))

    top_p = _per_row(top_p, batch, torch.float32, device)
    if top_p is not None:
        if bool(((top_p <= 0) | (top_p > 1)).any()):
            raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
        # top_p == 1 keeps everything explicitly: rounding can push the cumulative mass to 1 early.
        rows = (top_p < 1).nonzero()[:, 0]
        if rows.numel():
            sub = scaled[rows]
            sorted_probs, order = sub.softmax(dim=-1).sort(dim=-1, descending=True)
            mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [R, V] exclusive cumulative mass
            drop_sorted = mass_above >= top_p[rows][:, None]
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scaled[rows] = sub.masked_fill(drop, float("-inf"))

    probs = scaled.softmax(dim=-1)
    if bool(is_greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
        probs = torch.where(is_greedy[:, None], one_hot, probs)
    return probs


def group_rows_by_generator(
    generators: Sequence[torch.Generator | None], rows: Sequence[int]
) -> list[tuple[torch.Generator | None, list[int]]]:
    """`rows` grouped by the generator object each uses, in order of first appearance."""
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row in rows:
        generator = generators[row]
        groups.setdefault(id(generator), (generator, []))[1].append(row)
    return list(groups.values())


def exponential_(noise: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill float32 `noise` in place with Exp(1) draws from `generator`: `-log(U)`, `U ~ Uniform[0, 1)`
    (inverse transform; cheaper on CPU than `exponential_`). Never 0: `U < 1`; `U = 0` gives inf."""
    return noise.uniform_(generator=generator).log_().neg_()


def sample_from_probs(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """`token_ids [B]` int64 from unnormalized `probs [B, V]`: `argmax_v probs[v] / E_v`, `E_v ~ Exp(1)`."""
    batch, vocab_size = probs.shape
    noise = torch.empty(batch, vocab_size, dtype=torch.float32, device=probs.device)
    if generators is None or isinstance(generators, torch.Generator):
        exponential_(noise, generators)
    else:
        if len(generators) != batch:
            raise ValueError(f"{len(generators)} generators for {batch} rows")
        for generator, rows in group_rows_by_generator(generators, range(batch)):
            if len(rows) == 1:
                exponential_(noise[rows[0]], generator)
            else:  # rows sharing one generator (unseeded requests): one draw for all of them
                noise[rows] = exponential_(torch.empty(len(rows), vocab_size, device=probs.device), generator)
    return argmax(probs.float() / noise)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    generators: Generators = None,
) -> torch.Tensor:
    """`token_ids [B]` int64 sampled from `logits [B, V]` float32 (other args: see `probs_from_logits`)."""
    batch = logits.shape[0]
    is_greedy = _per_row(temperature, batch, torch.float32, logits.device) == 0
    token_ids = argmax(logits)
    sampled_rows = (~is_greedy).nonzero().flatten().tolist()
    if sampled_rows:
        probs = probs_from_logits(
            logits[sampled_rows],
            _per_row(temperature, batch, torch.float32, logits.device)[sampled_rows],
            None if top_k is None else _per_row(top_k, batch, torch.int64, logits.device)[sampled_rows],
            None if top_p is None else _per_row(top_p, batch, torch.float32, logits.device)[sampled_rows],
        )
        if generators is not None and not isinstance(generators, torch.Generator):
            generators = [generators[row] for row in sampled_rows]
        token_ids[sampled_rows] = sample_from_probs(probs, generators)
    return token_ids


def apply_penalties_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    output_counts: torch.Tensor,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition (CTRL, Keskar et al. 2019, section 4.1: divide a positive logit, multiply otherwise) over
    each row's listed tokens, then OpenAI's `logit -= frequency * count + presence * (count > 0)`, in place.

    logits: `[N, V]` float32, changed in place and returned; rows: `[R]` int64, the rows penalised.
    token_ids: `[R, M]` int64, row i's listed tokens (its prompt's and output's; a token may repeat).
    output_counts: `[R, M]` float32, each listed token's count in the row's output.
    presence_penalty, frequency_penalty, repetition_penalty: `[R]` float32 (None: off).
    """
    penalties = (presence_penalty, frequency_penalty, repetition_penalty)
    if numpy_writable(logits):
        flat = logits.numpy().reshape(-1)
        index = rows.numpy()[:, None] * logits.shape[1] + token_ids.numpy()
        arrays = [None if p is None else p.numpy() for p in penalties]
        flat[index] = penalized(flat[index], output_counts.numpy(), *arrays, where=np.where)
        return logits
    index = (rows[:, None], token_ids)
    logits[index] = penalized(logits[index], output_counts, *penalties, where=torch.where)
    return logits


def numpy_writable(x: torch.Tensor) -> bool:
    """True when `x.numpy()` is a writable view of `x` in place (contiguous CPU float32, no grad)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and not x.requires_grad


def penalized(values, counts, presence, frequency, repetition, where):  # noqa: ANN001, ANN202
    """The penalty rules over gathered `values [R, M]` (torch tensors or numpy arrays, with their `where`)."""
    if repetition is not None:
        values = where(values > 0, values / repetition[:, None], values * repetition[:, None])
    if frequency is not None:
        values = values - frequency[:, None] * counts
    if presence is not None:
        values = values - presence[:, None] * (counts > 0)
    return values


class Logprobs(NamedTuple):
    """Log-probabilities `log_softmax(logits)` of the logits given (`engine.sampler.token_logprobs`).

    token_logprobs: `[B]` float32, of the given tokens.
    token_ranks: `[B]` int64, 1 + number of tokens with a strictly larger logprob.
    top_token_ids: `[B, num_top]` int64, most likely tokens first.
    top_logprobs: `[B, num_top]` float32.
    """

    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> Logprobs:
    """Log-probabilities of `token_ids` and the `num_top` most likely tokens per row.

    logits: `[B, V]` float32; token_ids: `[B]` int64; num_top: 0 .. V (`SamplingParams.logprobs`).
    Raises ValueError: `num_top` outside `[0, V]` or mismatched shapes.
    """
    batch, vocab_size = logits.shape
    if not 0 <= num_top <= vocab_size:
        raise ValueError(f"num_top must be in [0, {vocab_size}], got {num_top}")
    if token_ids.shape != (batch,):
        raise ValueError(f"token_ids must be [{batch}], got {tuple(token_ids.shape)}")
    logprobs = logits.float().log_softmax(dim=-1)  # [B, V]
    token_logprobs = logprobs.gather(-1, token_ids[:, None].long())  # [B, 1]
    top_logprobs, top_token_ids = top_k_largest(logprobs, max(num_top, 1))
    token_ranks = torch.ones(batch, dtype=torch.int64, device=logits.device)
    below_top = (token_logprobs[:, 0] < top_logprobs[:, 0]).nonzero()[:, 0]
    if below_top.numel():
        token_ranks[below_top] += (logprobs[below_top] > token_logprobs[below_top]).sum(dim=-1)
    return Logprobs(token_logprobs[:, 0], token_ranks, top_token_ids[:, :num_top], top_logprobs[:, :num_top])


_TOP_K_CHUNK = 64
_CHUNK_OFFSETS: dict[torch.device, torch.Tensor] = {}  # per device: arange(_TOP_K_CHUNK)


def top_k_largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` of `x` `[B, V]`: values `[B, k]` (largest first) and their indices `[B, k]` int64.

    Only the k `_TOP_K_CHUNK`-wide chunks with the largest maxima are searched; a tie's index may differ.
    """
    batch, vocab_size = x.shape
    if vocab_size % _TOP_K_CHUNK or vocab_size < 8 * k * _TOP_K_CHUNK:
        return x.topk(k, dim=-1)
    maxima = x.view(batch, vocab_size // _TOP_K_CHUNK, _TOP_K_CHUNK).amax(dim=-1)
    top_chunks = maxima.topk(k, dim=-1).indices  # [B, k]
    offsets = _CHUNK_OFFSETS.get(x.device)
    if offsets is None:
        offsets = _CHUNK_OFFSETS[x.device] = torch.arange(_TOP_K_CHUNK, device=x.device)
    columns = torch.add(offsets, top_chunks[:, :, None], alpha=_TOP_K_CHUNK).view(batch, k * _TOP_K_CHUNK)
    values, positions = x.gather(1, columns).topk(k, dim=-1)
    return values, columns.gather(1, positions)
