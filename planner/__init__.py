"""Capacity planner: the same topology YAML simulated, searched, and held against reality.

step_model.py       the seam: StepShape (PrefillChunk, DecodeRow) and the StepTimeModel protocol
op_costs.py         FLOPs and bytes of each op of one step on one rank
rank_split.py       how a step's work splits over data-parallel attention ranks
comm_costs.py       EP dispatch/combine seconds, the statistical EP imbalance, link levels
perf_model.py       PerfModel: the roofline step-time model (implements StepTimeModel)
topology_models.py  perf_model_for(topology, role): a PerfModel per pool of a YAML
calibration.py      calibration files (efficiency factors measured by `pdcluster profile`)
profiling.py        `pdcluster profile`: measure the live engine here and fit the cpu factors
"""
