# Sluice: `make train` runs the CPU demo, `make test` runs the whole suite; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test bench preview clean

setup: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

train: setup
	$(PY) train.py experiment=demo $(ARGS)

# Two pytest workers (pytest-xdist): the suite's multi-process tests spend much of their time importing torch on
# one core or waiting out a timeout, which the other worker's tests fill. Work stealing keeps both busy to the end
# (a fixed split left one worker with the slow launch tests: 12 instead of about 10.5 minutes on 2 cores).
TEST_JOBS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal $(PYTEST_ARGS)

# Sleep schedules vs the simulator's ideal, the real model vs torch.distributed.pipelining, single-process
# overhead, rollout decoding vs transformers' generate, transport hop latency, EP, DP/ZeRO-1 vs DDP, TP vs DTensor,
# recompute vs torch.utils.checkpoint, compiled layers and the size sweep's quick cells (see
# scripts/bench/run_all.py): bench/results.json, docs/benchmarks.md, bench/timelines/*.png, bench/sizes.png. `make bench ARGS=--sizes`: the size sweep alone, every cell.
bench: setup
	$(PY) scripts/bench/run_all.py $(ARGS)

preview: setup
	$(PY) scripts/preview.py $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
