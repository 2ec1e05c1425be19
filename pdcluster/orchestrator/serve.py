"""Bring a topology up as a service: the Ray cluster (prefill + decode pools) behind the OpenAI API.

    with serve(topology) as service:      # Cluster.deploy + build_app + uvicorn on a thread
        print(service.url)                # http://127.0.0.1:8000 (port 0 in the YAML: a free port)

Used by `pdcluster deploy` (serves until interrupted) and `pdcluster demo` (replays a trace, then stops).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdcluster.orchestrator.api.app import build_topology_app
from pdcluster.orchestrator.api.server import ServerThread
from pdcluster.orchestrator.cluster import Cluster, DeployError
from pdcluster.orchestrator.topology import Topology, load_topology

logger = logging.getLogger(__name__)


@dataclass
class Service:
    """A deployed topology: `cluster` (the ServingBackend) and the HTTP `server` in front of it."""

    topology: Topology
    cluster: Cluster
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url


@contextmanager
def serve(
    topology: Topology | str | Path,
    port: int | None = None,
    log=logger.info,
    drain_timeout_s: float = 2.0,
) -> Iterator[Service]:
    """Deploy `topology` and serve it over HTTP; everything is torn down on exit (also on errors).

    Args:
        port: overrides `api.port` (0 picks a free port).
        drain_timeout_s: on exit, new connections are refused at once and requests in flight get up to
            this many seconds to finish before the actors stop (`ServerThread`; `pdcluster deploy`'s
            `--drain-timeout-s`).

    Raises:
        TopologyError: an invalid topology file; DeployError (one line): an actor or the HTTP server failed
            to start (e.g. the port was taken while the actors loaded), after everything is torn down.
    """
    topo = topology if isinstance(topology, Topology) else load_topology(topology)
    cluster = Cluster.deploy(topo, log=log)
    server = None
    try:
        app = build_topology_app(cluster, topo)
        host, bind_port = topo.api.host, topo.api.port if port is None else port
        try:
            server = ServerThread(app, host=host, port=bind_port, drain_timeout_s=drain_timeout_s).start()
        except (OSError, RuntimeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise DeployError(f"the HTTP server cannot serve on {host}:{bind_port}: {reason}") from exc
        log(
            f"serving {cluster.model_name} at {server.url} "
            "(OpenAI API: /v1/completions, /v1/chat/completions)"
        )
        yield Service(topo, cluster, server)
    finally:
        try:
            if server is not None:
                server.stop()
        finally:  # also when a second Ctrl-C cut the drain short
            cluster.shutdown()
