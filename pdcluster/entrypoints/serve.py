"""Bring a topology up as a service: the Ray cluster (prefill + decode pools) behind the OpenAI API."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdcluster.config import Topology, load_topology
from pdcluster.driver.cluster import Cluster, DeployError
from pdcluster.entrypoints.openai.app import build_topology_app
from pdcluster.entrypoints.openai.server import ServerThread, bind_server_socket

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

    Raises TopologyError: an invalid topology file; DeployError (one line): the HTTP address cannot be bound
        (checked first, and held from then on: `api.server.bind_server_socket`), or an actor or the
        HTTP server failed to start, after everything is torn down.
    """
    topo = topology if isinstance(topology, Topology) else load_topology(topology)
    host, bind_port = topo.api.host, topo.api.port if port is None else port
    try:  # held from before Ray starts: the ports Ray and the actors open meanwhile cannot be this one
        sock = bind_server_socket(host, bind_port)
    except (OSError, OverflowError) as exc:
        raise DeployError(f"the HTTP server cannot bind {host}:{bind_port}: {_reason(exc)}") from exc
    server = None
    try:
        cluster = Cluster.deploy(topo, log=log)
    except BaseException:
        sock.close()
        raise
    try:
        app = build_topology_app(cluster, topo)
        # /health says 503 until the caller has the service (so a SIGTERM after a 200 takes the drain path)
        app.state.starting = True
        # assigned before it starts, so a Ctrl-C while it starts stops it rather than closing its socket
        server = ServerThread(app, drain_timeout_s=drain_timeout_s, sock=sock)
        try:
            server.start()
        except (OSError, RuntimeError) as exc:
            where = "{}:{}".format(*sock.getsockname()[:2])
            raise DeployError(f"the HTTP server cannot serve on {where}: {_reason(exc)}") from exc
        log(
            f"serving {cluster.model_name} at {server.url} "
            "(OpenAI API: /v1/completions, /v1/chat/completions)"
        )
        service = Service(topo, cluster, server)
        app.state.starting = False
        yield service
    finally:
        try:
            if server is not None:
                server.stop()
        finally:  # also when a second Ctrl-C cut the drain short (stop() then cut the requests in flight)
            if server is None:  # else the server owns the socket and closes it once it no longer uses it
                sock.close()
            cluster.shutdown()


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
