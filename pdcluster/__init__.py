"""pdcluster: disaggregated prefill/decode serving of DeepSeek-V3-architecture models on Ray.

Subpackages: `models` (MLA, DeepSeekMoE, MTP; checkpoint loading; the bundled tiny checkpoint), `kernels`,
`engine` (paged MLA KV cache, scheduler, MTP speculative decoding), `prefill_node` and `decode_node` (the
Ray actors), `kvtransfer` (layer-wise KV handoff: shm, gRPC, torch.distributed), `orchestrator` (topology
YAML, deployment, routing, the OpenAI-compatible API, the `pdcluster` CLI) and `planner` (capacity planning).
Importing this package imports none of them. Docstrings and comments name modules relative to this
package (`engine.stopping` is `pdcluster.engine.stopping`); file paths are from the repository root.
"""
