"""Rank workers that take injected faults, stalls and delays at their checkpoints (`RankWorker._checkpoint`):
the production workers with test hooks added. Deploy them with `Cluster.deploy(..., worker_classes=
FAULT_WORKERS)` (what `tests.cluster.conftest.deployed_with_loop` does) or construct them in-process."""

from __future__ import annotations

import threading

from pdcluster.workers.decode import DecodeWorker
from pdcluster.workers.prefill import PrefillWorker
from pdcluster.workers.role_rank import DecodeRole, PrefillRole, RoleWorker

DELAY_POINTS = ("before_reserve", "after_reserve", "before_admit")


class FaultHooks:
    """Mixed in before a `RankWorker` role: `inject_fault`, `inject_stall` and `inject_delay` arm the
    role's checkpoints; set up before the worker's constructor starts its engine thread."""

    FAULT_POINTS: tuple[str, ...] = ()
    DELAY_POINTS: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs) -> None:
        self._hooks_lock = threading.Lock()
        self._faults: dict[str, int] = {}
        self._stall_s = 0.0
        self._stall_released = threading.Event()
        self._delays: dict[str, list[float]] = {}
        self._delays_released = threading.Event()
        self._rebalancing = threading.Event()
        super().__init__(*args, **kwargs)

    def inject_fault(self, where: str, count: int = 1) -> None:
        """The next `count` passes through `where` raise RuntimeError("injected fault at <where>").
        Raises ValueError: `where` is not one of this role's FAULT_POINTS."""
        if where not in self.FAULT_POINTS:
            raise ValueError(f"unknown fault point {where!r}")
        with self._hooks_lock:
            self._faults[where] = self._faults.get(where, 0) + count
        self._wake_engine_thread()

    def inject_stall(self, seconds: float) -> None:
        """The engine thread's next pass hangs `seconds` (or until `release_stall`) at its "loop" checkpoint,
        holding its locks; `load` is still answered."""
        self._stall_released.clear()
        self._stall_s = seconds
        self._wake_engine_thread()

    def release_stall(self) -> None:
        self._stall_released.set()

    def inject_delay(self, where: str, seconds: float, count: int = 1) -> None:
        """The next `count` passes through `where` wait `seconds` (holding no lock), or until
        `release_delays`: "before_reserve" (a reply late because the reservation is: an abort sent meanwhile
        overtakes it), "after_reserve" (reserved, its reply late), "before_admit" (received, admitted late).
        Raises ValueError for another point."""
        if where not in self.DELAY_POINTS:
            raise ValueError(f"unknown delay point {where!r}")
        with self._hooks_lock:
            self._delays_released.clear()
            self._delays.setdefault(where, []).extend([seconds] * count)

    def hold_next_rebalance(self, seconds: float) -> None:
        """Ask for an EPLB rebalance at the next step with work (every rank of the group joins it); this
        rank waits `seconds` (or until `release_delays`) inside it, between the load allreduce and moving
        the expert weights, `rebalancing()` saying True from then on."""
        runtime = self.engine.ep
        move = runtime._move_weights

        def held(old, new) -> None:
            del runtime._move_weights  # (once)
            self._rebalancing.set()
            self._delays_released.wait(seconds)
            move(old, new)

        self._delays_released.clear()
        runtime._move_weights = held
        runtime.rebalance_requested = True
        self._wake_engine_thread()

    def rebalancing(self) -> bool:
        return self._rebalancing.is_set()

    def release_delays(self) -> None:
        """End the injected delays now (those in progress and those armed)."""
        self._delays_released.set()

    def _checkpoint(self, where: str) -> None:
        with self._hooks_lock:
            delays = self._delays.get(where)
            delay_s = delays.pop(0) if delays else 0.0
            fault = self._faults.get(where, 0) > 0
            if fault:
                self._faults[where] -= 1
                if not self._faults[where]:
                    del self._faults[where]
        if delay_s and not self._delays_released.is_set():
            self._delays_released.wait(delay_s)
        if fault:
            raise RuntimeError(f"injected fault at {where}")
        if where == "loop" and self._stall_s > 0:
            stall_s, self._stall_s = self._stall_s, 0.0
            self._stall_released.wait(stall_s)

    def _checkpoint_armed(self) -> bool:
        with self._hooks_lock:
            return bool(self._faults) or self._stall_s > 0

    def _stop_engine_thread(self, timeout_s: float = 10.0) -> None:
        self._stall_released.set()
        super()._stop_engine_thread(timeout_s)


class FaultyPrefillWorker(FaultHooks, PrefillWorker):
    FAULT_POINTS = PrefillWorker.CHECKPOINTS


class FaultyDecodeWorker(FaultHooks, DecodeWorker):
    FAULT_POINTS = tuple(p for p in DecodeWorker.CHECKPOINTS if p not in DELAY_POINTS)
    DELAY_POINTS = DELAY_POINTS


class FaultyPrefillRole(FaultHooks, PrefillRole):
    FAULT_POINTS = PrefillWorker.CHECKPOINTS


class FaultyDecodeRole(FaultHooks, DecodeRole):
    FAULT_POINTS = FaultyDecodeWorker.FAULT_POINTS
    DELAY_POINTS = DELAY_POINTS


class FaultyRoleWorker(RoleWorker):
    """A `RoleWorker` whose roles take the hooks; they go with the role object (a switch starts clean)."""

    ROLE_CLASSES = {"prefill": FaultyPrefillRole, "decode": FaultyDecodeRole}


def _to_current_role(name: str):
    def method(self: RoleWorker, *args, **kwargs):
        return getattr(self.current, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _hook in ("inject_fault", "inject_stall", "release_stall", "inject_delay", "release_delays"):
    setattr(FaultyRoleWorker, _hook, _to_current_role(_hook))

FAULT_WORKERS = {"prefill": FaultyPrefillWorker, "decode": FaultyDecodeWorker, "role": FaultyRoleWorker}
