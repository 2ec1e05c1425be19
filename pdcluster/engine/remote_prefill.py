"""Disaggregated prefill in the engine: the prefill instance's export and the decode instance's import."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pdcluster.engine.model_runner import LayerKVCallback, ModelInput, ModelRunner
from pdcluster.engine.outputs import ModelRunnerOutput, ScheduledRequest, TokenLogprobs
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.scheduler import Scheduler
from pdcluster.kernels.kv_quant import dequantize_kv_int8
from pdcluster.kernels.paged_mla import bytes_crc32c, gather_kv, write_prompt_kv


class PrefillOutput(NamedTuple):
    """What a prefill-only request hands to decode besides its prompt KV (`LLMEngine.pop_prefill_result`).

    draft_probs: `[num_drafts, vocab_size]` float32 MTP probabilities of sampled drafts; None when greedy.
    """

    first_token_id: int
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None
    first_token_logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # `engine.prompt_logprobs`; None: not asked


PromptKVCallback = Callable[[str, int, torch.Tensor, torch.Tensor | None], None]


def prefill_result(runner_output: ModelRunnerOutput, request_id: str) -> PrefillOutput | None:
    """The `PrefillOutput` of a prefill-only request from its sampling step's output; None when the step
    sampled nothing for it (it failed).
    """
    sampled = runner_output.sampled_token_ids.get(request_id)
    if not sampled:
        return None
    return PrefillOutput(
        first_token_id=sampled[-1],
        draft_token_ids=list(runner_output.spec_token_ids.get(request_id, [])),
        draft_probs=runner_output.draft_probs.get(request_id),
        first_token_logprobs=(runner_output.logprobs.get(request_id) or [None])[-1],
    )


def prompt_kv_hook(
    runner: ModelRunner,
    items: list[ScheduledRequest],
    on_layer_kv: LayerKVCallback | None,
    on_prompt_kv: PromptKVCallback,
    defer_layer_idx: int | None = None,
) -> tuple[LayerKVCallback, Callable[[], None]]:
    """A `LayerKVCallback` that calls `on_layer_kv` (if any), then `on_prompt_kv` for each of `items`
    (prefill-only requests whose last prompt chunk runs in this step) with the whole prompt's KV of the
    layer, read back from the paged cache (so earlier chunks and prefix-cache hits are included) as the
    cache stores it: an int8 cache's values with their scales (no dequantization), else the model dtype.
    """
    tables = [
        (item.request_id, torch.tensor(item.block_ids, dtype=torch.long), item.request.num_prompt_tokens)
        for item in items
    ]
    deferred: list[int] = []

    def send(layer_idx: int) -> None:
        for request_id, table, num_prompt_tokens in tables:
            cache, kv_scale, local = runner.layer_cache(layer_idx, table)
            latent, scale = gather_kv(cache, local.to(runner.device), num_prompt_tokens, kv_scale)
            if scale is None and latent.dtype != runner.dtype:
                latent = latent.to(runner.dtype)
            on_prompt_kv(request_id, layer_idx, latent, scale)

    def hook(layer_idx: int, latent_kv: torch.Tensor, batch: ModelInput) -> None:
        if on_layer_kv is not None:
            on_layer_kv(layer_idx, latent_kv, batch)
        if layer_idx == defer_layer_idx:
            deferred.append(layer_idx)
        else:
            send(layer_idx)

    def flush() -> None:
        while deferred:
            send(deferred.pop(0))

    return hook, flush


class RemotePrefillReservations:
    """The decode side: requests whose prompt KV another instance computes, from reservation to admission."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        # reserved request id -> (its block table [num_blocks] int64 on the host, num_prompt_tokens)
        self._tables: dict[str, tuple[torch.Tensor, int]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def reserve(self, request: Request, num_draft_tokens: int) -> bool:
        """Hold KV blocks for a new request's prompt, first token and `num_draft_tokens` drafts (what its
        first decode step writes; `LLMEngine.reserve_remote_prefill` builds and checks the request).
        Raises ValueError: a duplicate id or a request that could never fit (`Scheduler.reserve`)."""
        num_prompt_tokens = request.num_prompt_tokens
        if not self.scheduler.reserve(request, num_prompt_tokens + 1 + num_draft_tokens):
            return False
        self.scheduler.block_manager.slot_mapping(request, 0, num_prompt_tokens)
        table = torch.tensor(self.scheduler.block_manager.block_ids(request), dtype=torch.long)
        self._tables[request.request_id] = (table, num_prompt_tokens)
        return True

    def block_ids(self, request_id: str) -> list[int]:
        """A reservation's block table, in position order."""
        return self._tables[request_id][0].tolist()

    def write_prompt_kv(
        self,
        request_id: str,
        layer_idx: int,
        latent_kv: torch.Tensor,
        scale: torch.Tensor | None = None,
        checksum_start: int | None = None,
    ) -> int | None:
        """One layer's received KV (`[num_prompt_tokens, kv_dim]`, model dtype; MTP: num_hidden_layers) into
        the reserved slots. Raises KeyError: no reservation; ValueError: shape, or checksum_start + scale."""
        table, num_prompt_tokens = self._tables[request_id]
        if latent_kv.shape[:1] != (num_prompt_tokens,):
            raise ValueError(
                f"{request_id}: layer {layer_idx} has {tuple(latent_kv.shape)[:1]} rows, the reservation "
                f"{num_prompt_tokens} prompt tokens"
            )
        if checksum_start is not None and scale is not None:
            raise ValueError(f"{request_id}: a checksum of the written bytes is for float layers, not int8")
        cache, kv_scale, table = self.runner.layer_cache(layer_idx, table)
        float_dtype = self.runner.dtype if kv_scale is not None else cache.dtype
        crc = None
        if checksum_start is not None and (
            latent_kv.device != self.runner.device or latent_kv.dtype != float_dtype
        ):
            crc, checksum_start = bytes_crc32c(latent_kv, checksum_start), None
        if scale is not None and kv_scale is None:
            latent_kv, scale = dequantize_kv_int8(latent_kv, scale, self.runner.dtype), None
        if scale is None:
            latent_kv = latent_kv.to(self.runner.device, float_dtype)
        else:
            latent_kv, scale = latent_kv.to(self.runner.device), scale.to(self.runner.device)
        written_crc = write_prompt_kv(cache, latent_kv, table, kv_scale, scale, checksum_start)
        return crc if crc is not None else written_crc

    def admit(
        self, request_id: str, first_token_id: int, draft_token_ids: list[int]
    ) -> tuple[Request, RequestStatus]:
        """Admit a reserved request whose prompt KV is written, with its first token and drafts
        (`Scheduler.admit_reserved`).
        Raises KeyError: no reservation."""
        self._tables.pop(request_id)
        request = self.scheduler.reserved[request_id]
        return request, self.scheduler.admit_reserved(request_id, first_token_id, list(draft_token_ids))

    def release(self, request_id: str) -> bool:
        """Give back a reservation's blocks (handoff failed or cancelled)."""
        self._tables.pop(request_id, None)
        return self.scheduler.release_reserved(request_id)


def export_callbacks(
    runner: ModelRunner,
    exporting: list[ScheduledRequest],
    on_layer_kv: LayerKVCallback | None,
    on_prompt_kv: PromptKVCallback | None,
    on_first_token: Callable[[str, int], None] | None,
    last_layer_idx: int,
) -> tuple[LayerKVCallback | None, Callable[[], None] | None, Callable[[dict[str, list[int]]], None] | None]:
    """A synchronous step's layer-KV hook, prompt-KV flush and `on_sampled` for its prefill-only requests."""
    hook, flush_prompt_kv = on_layer_kv, None
    if exporting and on_prompt_kv is not None:
        hook, flush_prompt_kv = prompt_kv_hook(runner, exporting, on_layer_kv, on_prompt_kv, last_layer_idx)
    on_sampled = None
    if exporting and (on_first_token is not None or flush_prompt_kv is not None):
        first_token_ids = {item.request_id for item in exporting}

        def on_sampled(sampled: dict[str, list[int]]) -> None:
            # First tokens out, then the last layer's KV, then (after this) the MTP pass.
            for request_id, tokens in sampled.items():
                if on_first_token is not None and request_id in first_token_ids and tokens:
                    on_first_token(request_id, tokens[-1])
            if flush_prompt_kv is not None:
                flush_prompt_kv()

    return hook, flush_prompt_kv, on_sampled
