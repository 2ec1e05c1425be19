"""The admin endpoint of dynamic P:D (`driver.role_moves`) and its `/metrics` families.

    GET  /admin/instances                  each instance's role and slot
    POST /admin/instances/{name}/role      {"role": "decode", "reason": "..."}: move it (blocks until done);
                                           "parked": drain it and keep it loaded out of routing

Bearer token: PDCLUSTER_ADMIN_TOKEN, else `autoscale.admin_token` (401 without one, 403 if wrong or unset).
409: a pool would be left empty, another move runs, the instance is not serving; 400: unknown role or
unmovable topology; 404: unknown instance; 500: the move began and failed (the message says where it is).
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field

from pdcluster.entrypoints.openai.protocol import ApiError

ADMIN_TOKEN_ENV = "PDCLUSTER_ADMIN_TOKEN"
# MoveRefused messages that are a conflict with the cluster's state (409); other refusals are 400
CONFLICTS = ("would leave", "one move at a time", "already a", "already parked", "not moved")


class RoleChange(BaseModel):
    role: str = Field(description="prefill, decode, or parked (loaded, out of routing)")
    reason: str = Field(default="by hand", max_length=200, description="for the log")


def admin_token(configured: str | None) -> str | None:
    """The admin token in force: the environment's, else the YAML's (None: the endpoint refuses all)."""
    return os.environ.get(ADMIN_TOKEN_ENV) or configured


def add_admin_routes(app: FastAPI, backend: Any, token: str | None) -> None:
    """Add the routes (see the module docstring) and the role/move metrics to `app.state.metrics`."""
    mover = getattr(backend, "mover", None)
    if mover is not None:
        app.state.metrics.registry.register(RoleCollector(mover))

    def authorize(request: Request) -> None:
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise ApiError(
                401, "the admin endpoint needs Authorization: Bearer <admin token>", "authentication_error"
            )
        if token is None:
            raise ApiError(
                403,
                f"the admin endpoint is off: set autoscale.admin_token or {ADMIN_TOKEN_ENV}",
                "permission_error",
            )
        if not hmac.compare_digest(header[7:].strip().encode(), token.encode()):
            raise ApiError(403, "invalid admin token", "permission_error")

    def the_mover() -> Any:
        if mover is None:
            raise ApiError(
                404, "this server has no prefill/decode pools to move instances between", "not_found"
            )
        return mover

    @app.get("/admin/instances")
    async def list_instances(request: Request) -> JSONResponse:
        authorize(request)
        m = the_mover()
        slots = [
            {
                "instance": s.home or s.name,
                "name": s.name,
                "role": s.role,
                "state": s.pool_state,
                "health": s.health.state.value,
            }
            for role in ("prefill", "decode")
            for s in m.instances[role]
            if s.pool_state != "away"
        ]
        return JSONResponse({"instances": slots, "movable": m.issue is None, "why_not": m.issue})

    @app.post("/admin/instances/{name}/role")
    async def move(name: str, body: RoleChange, request: Request) -> JSONResponse:
        from pdcluster.driver.role_moves import MoveFailed, MoveRefused

        authorize(request)
        m = the_mover()
        try:
            result = await asyncio.to_thread(m.move, name, body.role, f"admin: {body.reason}", "manual")
        except KeyError as e:
            raise ApiError(404, str(e.args[0]), "not_found") from e
        except MoveRefused as e:
            status = 409 if any(c in str(e) for c in CONFLICTS) else 400
            raise ApiError(status, str(e), "conflict" if status == 409 else "invalid_request_error") from e
        except MoveFailed as e:
            raise ApiError(500, f"the move began and failed: {e}", "server_error") from e
        return JSONResponse(result)


class RoleCollector(Collector):
    """`pdcluster_instance_role{instance,role}` (1 per instance) and the moves done and failed, by
    direction and trigger (`manual` | `controller`)."""

    def __init__(self, mover: Any) -> None:
        self.mover = mover

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        roles = GaugeMetricFamily(
            "pdcluster_instance_role",
            "The pool each instance serves, or parked (1).",
            labels=["instance", "role"],
        )
        for instance, role in sorted(self.mover.roles().items()):
            roles.add_metric([instance, role], 1)
        yield roles
        for name, counts, doc in (
            ("pdcluster_role_moves", self.mover.moves, "Instances moved between pools."),
            ("pdcluster_role_moves_failed", self.mover.failed, "Moves that began and failed."),
        ):
            family = CounterMetricFamily(name, doc, labels=["from_role", "to_role", "trigger"])
            for labels, count in sorted(counts.items()):
                family.add_metric(list(labels), count)
            yield family
