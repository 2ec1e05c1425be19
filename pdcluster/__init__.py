"""pdcluster: disaggregated prefill/decode serving of DeepSeek-V3-architecture models on Ray.

Subpackages: `models`, `kernels`, `engine` (one model instance), `kvtransfer` (the P->D KV handoff),
`config` (the topology YAML), `workers` (the prefill and decode rank actors), `driver` (the control plane),
`entrypoints` (HTTP server, CLI, batch job) and `planner` (capacity planning). Importing this package
imports none of them. Docstrings name modules relative to this package (`engine.stopping` is
`pdcluster.engine.stopping`).
"""
