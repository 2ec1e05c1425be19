"""`RoleWorker`: a single-device rank actor that serves as prefill or decode and changes role in place.

Its role (`PrefillRole` / `DecodeRole`: the `PrefillWorker` / `DecodeWorker` code) is built over the one
`LLMEngine` the actor loaded, so a move keeps the weights and the KV pool; `switch_role` runs once the
driver drained the instance (`driver.role_moves`).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import TYPE_CHECKING, Any

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm import LLMEngine
from pdcluster.workers.decode import DecodeWorker
from pdcluster.workers.prefill import PrefillWorker
from pdcluster.workers.rank_channel import close_driver_channel, serve_driver_channel

if TYPE_CHECKING:
    from pdcluster.driver.rank_wire import ChannelAddress
    from pdcluster.kvtransfer.grpc_transport import TLSCredentials
    from pdcluster.kvtransfer.paired import PairedAddress

logger = logging.getLogger(__name__)


class WrongRole(RuntimeError):
    """A call only the other role answers (the instance moved, or is moving)."""


class _GivenEngine:
    """Mixin: the role's engine is the one handed in, not loaded anew (`RankWorker._new_engine`)."""

    _given_engine: LLMEngine

    def _new_engine(self, engine_config: EngineConfig) -> LLMEngine:
        return self._given_engine


class PrefillRole(_GivenEngine, PrefillWorker):
    """`PrefillWorker` over an engine already loaded."""

    def __init__(self, engine: LLMEngine, name: str, layerwise: bool) -> None:
        self._given_engine = engine
        super().__init__(engine.config, name, layerwise)

    def is_idle(self) -> str | None:
        """None when no job is queued or active; else what is still there."""
        with self._lock:
            busy = len(self._active) or self._num_queued_tokens or not self._jobs.empty()
        sending = sum(len(s.pending_request_ids()) for s in self._all_senders())
        return (
            f"{len(self._active)} prefill jobs active, {sending} handoffs sending"
            if busy or sending
            else None
        )


class DecodeRole(_GivenEngine, DecodeWorker):
    """`DecodeWorker` over an engine already loaded."""

    def __init__(self, engine: LLMEngine, name: str, host: str) -> None:
        self._given_engine = engine
        super().__init__(engine.config, name, host)

    def is_idle(self) -> str | None:
        """None when nothing is reserved, admitted or running; else what is still there."""
        with self._locked():
            scheduler = self.engine.scheduler
            running, reserved = len(scheduler.requests), len(scheduler.reserved)
            busy = running or reserved or self._admissions or self._handoffs or self._fenced
        return f"{running} decode requests running, {reserved} reserved" if busy else None


ROLE_CLASSES: dict[str, type] = {"prefill": PrefillRole, "decode": DecodeRole}


class RoleWorker:
    """One single-device rank actor whose role (`prefill` | `decode`) changes with `switch_role`.

    `engine_configs`: each role's engine arguments (loaded with `role`'s). The current role answers every
    public method of `PrefillWorker` / `DecodeWorker`; one of the other role raises `WrongRole`.
    """

    def __init__(
        self,
        engine_configs: dict[str, EngineConfig],
        name: str,
        role: str,
        layerwise: bool = True,
        host: str = "127.0.0.1",
    ) -> None:
        if role not in ROLE_CLASSES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.name = name
        self.layerwise = layerwise
        self.host = host
        self._switch_lock = threading.Lock()
        self.num_switches = 0
        # loaded once, with the shared-memory KV cache decode's same-host senders write into
        engine = LLMEngine(engine_configs[role], shared_kv_cache=True)
        self.current = self._build(role, engine, name)

    ROLE_CLASSES: dict[str, type] = ROLE_CLASSES  # what `_build` makes (a test subclass adds fault hooks)

    def _build(self, role: str, engine: LLMEngine, name: str) -> Any:
        if role == "prefill":
            return self.ROLE_CLASSES["prefill"](engine, name, self.layerwise)
        return self.ROLE_CLASSES["decode"](engine, name, self.host)

    def role(self) -> str:
        """`prefill` or `decode`: the role serving now."""
        return "prefill" if isinstance(self.current, PrefillWorker) else "decode"

    def switch_role(
        self, role: str, name: str, transport: str | None = None, tls: TLSCredentials | None = None
    ) -> str | PairedAddress | None:
        """Become `role` (named `name` in logs) over the same engine; for decode, start its KV receiver on
        `transport` and return its address (None for prefill: the driver connects its senders).
        Raises ValueError (already `role`, or unknown), RuntimeError (the current role is not drained)."""
        if role not in ROLE_CLASSES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        with self._switch_lock:
            old = self.current
            if self.role() == role:
                raise ValueError(f"{old.name} is already a {role} instance")
            busy = old.is_idle()
            if busy is not None:
                raise RuntimeError(f"{old.name}: not drained, cannot become {role}: {busy}")
            old.close()  # its engine thread and transport; the engine, its weights and KV pool stay
            self.current = self._build(role, old.engine, name)
            self.num_switches += 1
            logger.info("%s: %s -> %s in place (same engine, KV pool reused)", name, old.name, role)
            if role == "decode":
                assert transport is not None, "a decode role listens on the deployment's KV transport"
                return self.current.start_receiver(transport, tls)
            return None

    def serve_driver_channel(self) -> ChannelAddress:
        """`workers.rank_channel.serve_driver_channel` for this actor: calls go to the current role."""
        return serve_driver_channel(self, self.name)

    def close(self) -> None:
        close_driver_channel(self)
        self.current.close()


def _forwarded(method_name: str) -> Any:
    def call(self: RoleWorker, *args: Any, **kwargs: Any) -> Any:
        target = getattr(self.current, method_name, None)
        if target is None:
            raise WrongRole(f"{self.current.name} is a {self.role()} instance: it has no {method_name}")
        return target(*args, **kwargs)

    def streamed(self: RoleWorker, *args: Any, **kwargs: Any) -> Any:
        yield from call(self, *args, **kwargs)

    roles = (PrefillWorker, DecodeWorker)
    generator = any(inspect.isgeneratorfunction(getattr(c, method_name, None)) for c in roles)
    method = streamed if generator else call
    method.__name__ = method.__qualname__ = method_name
    return method


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


for _name in sorted((_public_methods(PrefillWorker) | _public_methods(DecodeWorker)) - set(vars(RoleWorker))):
    setattr(RoleWorker, _name, _forwarded(_name))
