"""The capacity planner: performance model, discrete-event simulator, search and report (`pdcluster plan`)."""

# MTP acceptance per draft position where none is given: DeepSeek-V3 technical report (arXiv:2412.19437),
# section 5.4.3, "the acceptance rate of the second token prediction ranges between 85% and 90%".
DEFAULT_ACCEPTANCE = 0.85
