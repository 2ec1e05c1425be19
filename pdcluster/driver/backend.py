"""What the HTTP edge needs from whatever serves tokens: the `ServingBackend` protocol."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pdcluster.driver.messages import DraftCounts, Phases
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm import EngineStepError, LLMEngine, RequestOutput
from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models.tokenizer import Tokenizer

# Names of the per-request phases a backend may report in `StreamDelta.phases` (seconds), in the order a
# request meets them. A backend gives the ones it knows; a local engine has no KV transfer.
PHASE_NAMES = tuple(f.name for f in dataclasses.fields(Phases))


class BackendUnavailable(Exception):
    """A retriable failure: the request was not served, and trying again later may succeed (HTTP 503)."""


@dataclass
class StreamDelta:
    """One increment of a request's output, in commit order."""

    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    kv_transfer_bytes: int | None = None
    drafts: DraftCounts = DraftCounts()
    new_text: str = ""
    ranks: dict[str, str] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None
    # every prompt token's (`SamplingParams.prompt_logprobs`; None at index 0), on the first delta only
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def reported_phases(self) -> dict[str, float | int]:
        """The phases as reports show them (`pdcluster.phases` of the HTTP API, job records): the seconds
        of `phases` (and `recomputed_tokens`, a count, after a lost decode's re-dispatch: `driver.recompute`)
        plus `kv_transfer_bytes` (bytes) when known."""
        if self.kv_transfer_bytes is None:
            return dict(self.phases)
        return {**self.phases, "kv_transfer_bytes": self.kv_transfer_bytes}


@runtime_checkable
class ServingBackend(Protocol):
    """A token server the HTTP edge can drive (see the module docstring)."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        """Stream the request's output (an async generator: `async def ... yield`).

        Raises ValueError: a request the backend cannot take (e.g. larger than its KV cache).
        Raises BackendUnavailable: a retriable failure.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop the request and free its resources; unknown or finished ids are ignored."""
        ...

    def stats(self) -> dict[str, Any]:
        """A snapshot for metrics; may block, so call it off the event loop. Keys (all optional):
        num_waiting_requests, num_running_requests: int; kv_blocks: {instance_name: {"num_used_blocks",
        "num_total_blocks"}}; kv_transfer_bytes_total: int bytes; kv_transfer_seconds_total: float seconds.
        """
        ...

    def check_ready(self) -> None:
        """Return if the backend can take requests now, from what it knows without any call.

        Raises BackendUnavailable: it cannot; the message says why.
        """
        ...


# ---- local backend ------------------------------------------------------------------------------------
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class LocalEngineBackend:
    """One `LLMEngine` stepped on a background thread."""

    def __init__(
        self, engine_config: EngineConfig, engine: LLMEngine | None = None, name: str = "local"
    ) -> None:
        self.engine = engine or LLMEngine(engine_config)
        self.model_name = _model_name(engine_config.model)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.instance_name = name
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams and the stats snapshot
        self._stats: dict[str, Any] = self._snapshot()
        self._stopped = threading.Event()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="pdcluster-engine", daemon=True)
        self._thread.start()

    # ---- protocol -------------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        if self._stopped.is_set():
            raise BackendUnavailable("the local engine is shut down")
        loop = asyncio.get_running_loop()
        out_queue: asyncio.Queue = asyncio.Queue()
        added: asyncio.Future = loop.create_future()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, out_queue)
        self._commands.put(("add", (request_id, list(prompt_token_ids), params, time.monotonic(), added)))
        finished = False
        try:
            await added  # raises the engine's ValueError for a request it cannot take
            num_sent = 0
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                out: RequestOutput = item
                if out.finish_reason == "error":
                    finished = True  # the engine already dropped it
                    raise BackendUnavailable(f"the engine failed this request: {out.error}")
                delta = _delta(out, out.token_ids[num_sent:])
                num_sent = len(out.token_ids)
                finished = out.finished
                yield delta
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (or an error): free the engine's side
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)

    def check_ready(self) -> None:
        if self._stopped.is_set():
            raise BackendUnavailable(f"{self.instance_name}: the engine is shut down")
        if not self._thread.is_alive():
            raise BackendUnavailable(f"{self.instance_name}: the engine thread ended")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (after the step in progress); pending streams get BackendUnavailable."""
        self._stopped.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout_s)

    # ---- engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished_requests()
            try:
                cmd, arg = self._commands.get(block=block)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd == "stop":
                    self._fail_all(BackendUnavailable("the local engine is shut down"))
                    return
                self._apply(cmd, arg)
                try:
                    cmd, arg = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except EngineStepError as exc:  # the step's requests failed (error outputs); others go on
                    outputs = exc.outputs
                except Exception as exc:  # noqa: BLE001 - not tied to requests: fails every one, not the thread
                    self._fail_all(BackendUnavailable(f"engine step failed: {exc!r}"))
                    self._abort_everything()
                    outputs = []
                self._update_stats()  # before the outputs go out: a client that sees a token sees its blocks
                for out in outputs:
                    self._dispatch(out.request_id, out)
            self._update_stats()

    def _apply(self, cmd: str, arg: Any) -> None:
        if cmd == "add":
            request_id, token_ids, params, arrival_s, added = arg
            try:
                self.engine.add_request(token_ids, params, request_id=request_id, arrival_time_s=arrival_s)
            except ValueError as exc:
                self._resolve(added, exc)
                return
            self._resolve(added, None)
        elif cmd == "abort":
            if self.engine.abort_request(arg):
                # hand the final "abort" output over now rather than with the next step (there may be none)
                for output in self.engine.pop_finished_outputs([arg]):
                    self._dispatch(arg, output)

    def _resolve(self, future: asyncio.Future, exc: BaseException | None) -> None:
        def set_result() -> None:
            if future.done():
                return
            if exc is None:
                future.set_result(None)
            else:
                future.set_exception(exc)

        with contextlib.suppress(RuntimeError):  # the loop is closed
            future.get_loop().call_soon_threadsafe(set_result)

    def _dispatch(self, request_id: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None or item is None:
            return
        loop, out_queue = stream
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(out_queue.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for loop, out_queue in streams:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(out_queue.put_nowait, exc)

    def _abort_everything(self) -> None:
        scheduler = self.engine.scheduler
        for request_id in list(scheduler.requests):
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
                self.engine.pop_finished_outputs([request_id])

    def _snapshot(self) -> dict[str, Any]:
        scheduler = self.engine.scheduler
        block_manager = scheduler.block_manager
        num_total = block_manager.num_blocks
        return {
            "num_waiting_requests": len(scheduler.waiting),
            "num_running_requests": len(scheduler.running),
            "kv_blocks": {
                self.instance_name: {
                    "num_used_blocks": num_total - block_manager.num_free_blocks,
                    "num_total_blocks": num_total,
                }
            },
        }

    def _update_stats(self) -> None:
        snapshot = self._snapshot()
        with self._lock:
            self._stats = snapshot


def _model_name(model_dir: str) -> str:
    from pathlib import Path

    return Path(model_dir).resolve().name


def _delta(out: RequestOutput, new_token_ids: list[int]) -> StreamDelta:
    phases: dict[str, float] = {}
    if out.queue_s is not None:
        phases["queue_s"] = out.queue_s
    if out.ttft_s is not None:
        # local engine: no KV transfer; the engine reports decode steps only as their mean (tpot_s)
        phases["prefill_s"] = max(0.0, out.ttft_s - (out.queue_s or 0.0))
        phases["kv_transfer_s"] = 0.0
    if out.e2e_s is not None:
        phases["total_s"] = out.e2e_s
    return StreamDelta(
        new_token_ids=list(new_token_ids),
        finished=out.finished,
        finish_reason=_FINISH_REASONS.get(out.finish_reason, out.finish_reason) if out.finished else None,
        phases=phases,
        drafts=out.drafts,
        new_text=out.new_text,
        logprobs=None if out.logprobs is None else out.logprobs[len(out.token_ids) - len(new_token_ids) :],
        prompt_logprobs=out.prompt_logprobs if len(new_token_ids) == len(out.token_ids) else None,
    )
