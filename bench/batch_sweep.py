"""One engine, several batch sizes: the loop the engine-step benchmarks share (`bench.sampling_cost`,
`bench.spec_overhead`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from bench.common import environment

Measure = Callable[[Any, int, list[str], argparse.Namespace], dict[str, Any]]


def sweep_batch_sizes(args: argparse.Namespace, measure: Measure, config: dict[str, Any]) -> dict[str, Any]:
    """`measure(base, batch_size, prompts, args)` for each of `args.batch_sizes`, `base` being one `LLM` on
    `args.model` (each measure derives its engine with `base.replace_config`) and `prompts` the held-out
    prompts of the largest batch; returns `{"config": environment(args.model) | config, "results": [...]}`.
    """
    from pdcluster.engine.llm import LLM
    from pdcluster.models.prompts import heldout_def_prompts

    prompts = heldout_def_prompts(max(args.batch_sizes))
    base = LLM(args.model, num_kv_blocks=8, block_size=16)
    results = [measure(base, b, prompts, args) for b in args.batch_sizes]
    return {"config": {**environment(args.model), **config}, "results": results}
