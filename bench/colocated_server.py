"""pdcluster's colocated server for `bench.azure_replay`: one `LLMEngine` (prefill and decode in the same
engine, on one thread of its own) behind `driver.backend.LocalEngineBackend` and the OpenAI API
with the topology's API settings (`entrypoints.openai.app.build_topology_app`), in the foreground:

    python -m bench.colocated_server --topology clusters/local.yaml --port 8001

The engine takes the topology's decode `EngineConfig` (model, dtype, MTP k, KV cache, max_model_len,
prefix caching: the same engine arguments the decode actor of `pdcluster deploy` gets) and `--threads`
torch threads (default 1, like each actor of the deployment: OMP_NUM_THREADS=1); the API takes the
topology's SLO, body-size and concurrency limits. Stops cleanly on SIGTERM or Ctrl-C (uvicorn's handlers),
exit code 0.
"""

from __future__ import annotations

import argparse
import signal


def main(argv: list[str] | None = None) -> int:
    import torch
    import uvicorn

    from pdcluster.config import load_topology
    from pdcluster.driver.backend import LocalEngineBackend
    from pdcluster.entrypoints.openai.app import build_topology_app

    parser = argparse.ArgumentParser(prog="python -m bench.colocated_server", description=__doc__)
    parser.add_argument("--topology", default="clusters/local.yaml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    topo = load_topology(args.topology)
    backend = LocalEngineBackend(topo.engine_config("decode"))
    app = build_topology_app(backend, topo)
    # uvicorn handles SIGTERM/SIGINT while it serves (a graceful shutdown), then re-raises the signal to
    # the handler it found: a no-op one lets `backend.shutdown()` run and the process exit with code 0.
    # Before this point (while the engine loads) SIGTERM's default action ends the process: it owns nothing
    # that outlives it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        backend.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
