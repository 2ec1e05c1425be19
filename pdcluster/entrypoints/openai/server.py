"""Running the app: `ServerThread` (uvicorn on a background thread, for the tests, `pdcluster deploy`,
`pdcluster bench --endpoint local`) and `main`, a single-engine server in the foreground.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import socket
import threading
import time

from fastapi import FastAPI

from pdcluster.config import (
    CONCURRENT_REQUESTS_PER_DECODE_SEAT,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    SLOConfig,
)
from pdcluster.entrypoints.openai.app import build_app


class _DrainLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)"):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "the drain timeout ran out: %s request(s) still in flight were cut"
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def _install_drain_log_filter() -> None:
    uvicorn_logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DrainLogFilter) for f in uvicorn_logger.filters):
        uvicorn_logger.addFilter(_DrainLogFilter())


def bind_server_socket(host: str, port: int) -> socket.socket:
    """A TCP/IPv4 socket bound to `host:port` (0: a free port), not yet listening.

    Raises OSError: the bind failed (address in use, no permission, not an address of this machine).
    Raises OverflowError: port not in [0, 65535].
    """
    for reuse in (False, True):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if reuse:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            return sock
        except OSError as exc:
            sock.close()
            if reuse or exc.errno != errno.EADDRINUSE:
                raise
        except BaseException:
            sock.close()
            raise
    raise AssertionError("unreachable")


class ServerThread:
    """uvicorn serving `app` on `host` (a free port with port=0) in a background thread; `stop()` ends it."""

    FORCED_EXIT_S = 10.0  # uvicorn's loop ticks every 0.1 s; what it then does without the drain is quick

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        drain_timeout_s: float = 2.0,
        *,
        sock: socket.socket | None = None,
    ) -> None:
        import uvicorn

        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        self.drain_timeout_s = drain_timeout_s

        self._socket = bind_server_socket(host, port) if sock is None else sock
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=drain_timeout_s
        )
        _install_drain_log_filter()  # after Config, which (re)configures uvicorn's loggers
        self.server = uvicorn.Server(config)
        # set when uvicorn's thread is done (Thread.is_alive is wrong after a join a signal interrupted)
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdcluster-http", daemon=True)

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._socket])
        finally:
            self._ended.set()

    @property
    def running(self) -> bool:
        """Whether uvicorn's thread has started and not yet ended."""
        return self._thread.ident is not None and not self._ended.is_set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        """Listen on the socket and start serving; returns once uvicorn is up.

        Raises OSError: the socket cannot listen (EADDRINUSE: another socket listens on its port already).
        Raises RuntimeError: uvicorn did not start within `timeout_s` seconds (its thread is stopped first).
        """
        # SO_REUSEADDR, inherited by accepted connections, so a restart can bind the port despite TIME_WAIT.
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.listen(self.server.config.backlog)  # here, so that a failure is an OSError with a reason
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self._ended.is_set() or time.monotonic() > deadline:
                self.server.should_exit = True  # the caller's stop() closes the socket once uvicorn ended
                self._ended.wait(10.0)
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Refuse new connections, let requests in flight finish (`drain_timeout_s`), then end."""
        if self._thread.ident is None:
            self._socket.close()
            return
        try:
            self.server.should_exit = True
            self._ended.wait(self.drain_timeout_s + 10.0)  # + uvicorn's own shutdown steps
        except BaseException:
            self.server.force_exit = True
            self._ended.wait(self.FORCED_EXIT_S)
            raise
        finally:
            if not self.running:  # else uvicorn closes it itself when its shutdown gets there
                self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m pdcluster.entrypoints.openai`: one LocalEngineBackend behind the API (foreground)."""
    import uvicorn

    from pdcluster.driver.backend import LocalEngineBackend
    from pdcluster.engine.config import EngineConfig
    from pdcluster.models import bundled_checkpoint_dir

    parser = argparse.ArgumentParser(prog="python -m pdcluster.entrypoints.openai", description=main.__doc__)
    parser.add_argument(
        "--model",
        default=str(bundled_checkpoint_dir()),
        help="checkpoint directory (default: the bundled one)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--api-key", default=None, help="bearer token every path but /health and /metrics requires"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="prompt + output tokens (default: the model's)"
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=0, help="MTP draft tokens per step (default: 0, off)"
    )
    parser.add_argument("--ttft-slo-ms", type=float, default=None, help="TTFT SLO for goodput metrics")
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="TPOT SLO for goodput metrics")
    parser.add_argument(
        "--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES, help="larger: 413"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help=f"beyond it 429 (default: {CONCURRENT_REQUESTS_PER_DECODE_SEAT} x the engine's max_num_seqs)",
    )
    args = parser.parse_args(argv)
    backend = LocalEngineBackend(
        EngineConfig(
            model=args.model,
            max_model_len=args.max_model_len,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    )
    slo = SLOConfig(ttft_ms=args.ttft_slo_ms, tpot_ms=args.tpot_slo_ms)
    max_concurrent = args.max_concurrent_requests
    if max_concurrent is None:
        max_concurrent = CONCURRENT_REQUESTS_PER_DECODE_SEAT * backend.engine.config.max_num_seqs
    app = build_app(
        backend,
        api_key=args.api_key,
        slo=slo,
        max_request_body_bytes=args.max_request_body_bytes,
        max_concurrent_requests=max_concurrent,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        backend.shutdown()
    return 0
