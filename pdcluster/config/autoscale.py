"""The topology's `autoscale:` section (dynamic P:D, `driver.autoscale`) and its cross-section rules.

autoscale:
  enabled: true
  window_s: 10        # signals averaged over the last 10 s
  dwell_s: 30         # no move within 30 s of the last one
  prefill: {min_instances: 1, max_instances: 3}
  decode: {min_instances: 1}
  admin_token: s3cret  # POST /admin/instances/{name}/role (PDCLUSTER_ADMIN_TOKEN overrides it)
  calibration: local.calibration.json  # `pdcluster profile` JSON the controller prices capacity with
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pdcluster.config.fields import (
    MAX_INSTANCES,
    MAX_TIMEOUT_S,
    above_at_most,
    api_key_problem,
    at_least,
    between,
    check_fields,
)
from pdcluster.config.issues import Issue
from pdcluster.driver.autoscale import Policy


@dataclass(frozen=True)
class PoolBounds:
    """Active instances a pool keeps under autoscaling: at least `min_instances` (>= 1, so a pool is never
    emptied), at most `max_instances` (null: every device)."""

    min_instances: int = field(default=1, metadata=between(1, MAX_INSTANCES))
    max_instances: int | None = field(default=None, metadata=between(1, MAX_INSTANCES))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_instances is not None and self.max_instances < self.min_instances:
            raise ValueError(
                f"PoolBounds: max_instances {self.max_instances} < min_instances {self.min_instances}"
            )


@dataclass(frozen=True)
class AutoscaleConfig:
    """Dynamic P:D: when `enabled`, the controller (unless `controller` is false: moves by hand only) moves
    single-device instances between the pools (and with `park` parks them at low load: loaded, out of routing)
    every `interval_s`, from signals over `window_s`: at most one move per decision and `max_moves_in_flight`
    under way at once (they may overlap); while moves are under way or within `dwell_s` of the last one's
    end, only moves to the same pool (no reversal, no parking; unparking excepted); a leaving instance
    finishes its queue or running requests within `drain_timeout_s`, else (`recompute_at_drain_bound`) its
    running requests are re-dispatched through prefill, or the move fails and it stays. Utilizations
    (`driver.autoscale`): move above `target_utilization` when a move lowers the peak by `hysteresis`;
    park below `park_below_utilization`."""

    enabled: bool = False
    controller: bool = True  # false: instances move by hand only (the admin endpoint)
    interval_s: float = field(default=1.0, metadata=above_at_most(0, MAX_TIMEOUT_S))
    window_s: float = field(default=10.0, metadata=above_at_most(0, MAX_TIMEOUT_S))
    dwell_s: float = field(default=30.0, metadata=between(0, MAX_TIMEOUT_S))
    hysteresis: float = field(default=0.15, metadata=between(0, 1))
    target_utilization: float = field(default=0.8, metadata=above_at_most(0, 4))
    drain_timeout_s: float = field(default=60.0, metadata=above_at_most(0, MAX_TIMEOUT_S))
    # at the drain bound a leaving decode instance's running requests are re-dispatched with their
    # streamed tokens kept (`driver.recompute`: their KV computed again, counted), if each allows it
    recompute_at_drain_bound: bool = True
    park: bool = False
    park_below_utilization: float = field(default=0.4, metadata=at_least(0))
    # moves the controller may have under way at once (the simulator's; the live mover makes one at a time)
    max_moves_in_flight: int = field(default=1, metadata=between(1, MAX_INSTANCES))
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    # bearer token of the admin endpoint that moves instances by hand (None: PDCLUSTER_ADMIN_TOKEN, or off)
    admin_token: str | None = field(default=None, metadata={"check": api_key_problem})
    # `pdcluster profile` JSON pricing each pool's capacity (None: the catalog's efficiency for the hardware)
    calibration: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.interval_s > self.window_s:
            raise ValueError(f"AutoscaleConfig: interval_s {self.interval_s} > window_s {self.window_s}")
        if self.park_below_utilization >= self.target_utilization:
            raise ValueError(
                f"AutoscaleConfig: park_below_utilization {self.park_below_utilization} must be < "
                f"target_utilization {self.target_utilization} (else parking and unparking alternate)"
            )

    def policy(self, ttft_slo_s: float, tpot_slo_s: float, num_instances: int) -> Policy:
        """The controller's `Policy` for a cluster of `num_instances` single-device instances."""
        return Policy(
            ttft_slo_s=ttft_slo_s,
            tpot_slo_s=tpot_slo_s,
            dwell_s=self.dwell_s,
            hysteresis=self.hysteresis,
            target_utilization=self.target_utilization,
            drain_timeout_s=self.drain_timeout_s,
            park=self.park,
            park_below_utilization=self.park_below_utilization,
            max_moves_in_flight=self.max_moves_in_flight,
            prefill_bounds=(self.prefill.min_instances, self.prefill.max_instances or num_instances),
            decode_bounds=(self.decode.min_instances, self.decode.max_instances or num_instances),
        )


def autoscale_issues(sections: dict) -> Iterator[Issue]:
    """With `autoscale.enabled`: both pools single-device (re-forming a multi-device instance at the other
    pool's shape is elastic EP's), a readable `calibration`, and the file's split within the bounds, whose
    minimums fit together."""
    config: AutoscaleConfig | None = sections.get("autoscale")
    prefill, decode = sections.get("prefill"), sections.get("decode")
    if config is None or not config.enabled or prefill is None or decode is None:
        return
    for role, pool in (("prefill", prefill), ("decode", decode)):
        if pool.devices_per_instance != 1:
            yield Issue(
                ("autoscale", "enabled"),
                f"autoscale.enabled: moves single-device instances only, but {role}.devices_per_instance is "
                f"{pool.devices_per_instance}",
            )
            return
    if config.calibration is not None:
        from pdcluster.planner.calibration import read_calibration

        try:
            read_calibration(config.calibration)
        except ValueError as e:
            yield Issue(("autoscale", "calibration"), f"autoscale.calibration: {e}")
    total = prefill.num_instances + decode.num_instances
    for role, pool, bounds in (("prefill", prefill, config.prefill), ("decode", decode, config.decode)):
        if pool.num_instances < bounds.min_instances:
            yield Issue(
                ("autoscale", role, "min_instances"),
                f"autoscale.{role}.min_instances: {bounds.min_instances} > {role}.num_instances "
                f"{pool.num_instances} (the file's split must be within the bounds)",
            )
        if bounds.max_instances is not None and pool.num_instances > bounds.max_instances:
            yield Issue(
                ("autoscale", role, "max_instances"),
                f"autoscale.{role}.max_instances: {bounds.max_instances} < {role}.num_instances "
                f"{pool.num_instances} (the file's split must be within the bounds)",
            )
    if config.prefill.min_instances + config.decode.min_instances > total:
        yield Issue(
            ("autoscale", "decode", "min_instances"),
            f"autoscale: prefill.min_instances {config.prefill.min_instances} + decode.min_instances "
            f"{config.decode.min_instances} > the {total} instances of the file",
        )
