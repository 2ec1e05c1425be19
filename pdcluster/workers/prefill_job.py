"""`Job`: one prefill request on a `PrefillWorker`, from its `prefill` call until its caller's last reply."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import torch

from pdcluster.driver.messages import PrefillFirstToken, PrefillRequest, PrefillResult
from pdcluster.engine.remote_prefill import PrefillOutput
from pdcluster.kvtransfer.base import HandoffMeta


@dataclass
class Job:
    """One prefill request on this node, from `prefill` until its caller is woken (`done`)."""

    request: PrefillRequest
    # where the handoff goes: the request's, or a `PrefillBind`'s (None: awaiting the bind, not begun)
    meta: HandoffMeta | None = None
    decode_index: int = 0
    decode_rank: int = 0
    # prefilled while awaiting the bind: (first-token result, queue_s), finished once bound
    pending: tuple[PrefillOutput, float] | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    deadline_s: float = math.inf  # monotonic time its caller's waits give up (`PrefillWorker._wait`)
    timeout_s: float = math.inf
    done: threading.Event = field(default_factory=threading.Event)
    sampled: threading.Event = field(default_factory=threading.Event)
    first: PrefillFirstToken | None = None
    result: PrefillResult | None = None
    error: str | None = None
    # layerwise off: buffered layers, (latent_kv, scale) as the engine's PromptKVCallback gives them
    layers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    num_layers_sent: int = 0
    last_layer_sent_s: float | None = None  # monotonic time the last layer went to the sender
    # the engine thread's run-queue wait (s) during the steps this job was in the engine for; None: unknown
    cpu_wait_s: float | None = 0.0
    # why handing its KV to the sender failed inside a step (`PrefillWorker._on_prompt_kv`); failed after it
    step_error: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.handoff_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    def __post_init__(self) -> None:
        if not self.request.awaiting_bind:
            self.bind(self.request.meta, self.request.decode_index, self.request.decode_rank)

    def wake(self) -> None:
        """End its caller's waits: for the last reply, and for the first (a job ended before it failed)."""
        self.done.set()
        self.sampled.set()

    @property
    def bound(self) -> bool:
        return self.meta is not None

    def bind(self, meta: HandoffMeta, decode_index: int, decode_rank: int) -> None:
        self.meta, self.decode_index, self.decode_rank = meta, decode_index, decode_rank
