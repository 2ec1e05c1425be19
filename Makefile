# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-under-load test-netns load-test install lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU wheel of torch 2.13.0 is the one this project pins; other versions download GBs.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdcluster demo

# Two xdist workers, each taking whole files (a module's cluster is deployed once, for its tests): most of
# the suite waits on Ray actors and child processes, so two files at a time overlap those waits.
# --durations: the slowest tests, so a run's log says where the suite's time went (budget ~10 minutes).
PYTEST_WORKERS ?= -n 2 --dist loadfile
test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_WORKERS) --durations=15

# The whole suite while two bounded CPU burners (one per core here) keep the machine busy: a suite that
# passes only on an idle machine fails for users. The burners stop with the suite, or after an hour.
test-under-load: $(STAMP)
	$(PY) -m tests.cpu_burner --max-seconds 3600 -- $(PY) -m pytest -q $(PYTEST_WORKERS)

# Two Ray nodes in two network namespaces joined by a veth pair (root; iproute2): prefill on one, decode
# on the other, KV across the link; bandwidth limits and a cut mid-transfer (tests/netns/). Everything it
# starts lives in namespaces it creates and deletes; no traffic leaves them.
test-netns: $(STAMP)
	tests/netns/run_two_node.sh

# 1,000 concurrent streams (8 tokens each, loopback, 300 s deadline) from a separate client process against
# clusters/local.yaml: each completes or is refused (429/503 + Retry-After) before its stream starts; none
# is killed mid-stream; prints counts, p50/p99 of the completed and whether the cluster held nothing after.
LOAD_TEST_ARGS ?= --num-streams 1000 --max-tokens 8 --deadline-s 300
load-test: $(STAMP)
	@$(PY) -m bench.load_streams --cluster clusters/local.yaml $(LOAD_TEST_ARGS) --json

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info

# Regenerate the gRPC/protobuf stubs from pdcluster/protos/*.proto (see pdcluster/protos/README.md); run
# from the repo root.
.PHONY: protos
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. pdcluster/protos/kv_transfer.proto
