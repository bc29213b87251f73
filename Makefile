# The two commands of the README, plus helpers. Each target sets up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo sharded-jit-demo test test-fast test-tpu faults lint bench clean

$(BIN)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,tpu,wandb]'
	touch $@

# DEMO_FLAGS are appended to spmd-train's (tests/test_demo.py runs a few steps in a
# temporary DEMO_WORKDIR).
DEMO_WORKDIR ?= workdir/lm_tiny
DEMO_FLAGS ?=
demo: $(BIN)/.installed
	$(BIN)/spmd-launch local --num-processes 2 --devices-per-process 2 --timeout 900 -- \
		$(BIN)/spmd-train --config=configs/lm_tiny.py --workdir=$(DEMO_WORKDIR) $(DEMO_FLAGS)

sharded-jit-demo: $(BIN)/.installed
	$(BIN)/spmd-launch local --num-processes 2 --devices-per-process 2 --timeout 300 -- \
		$(BIN)/python examples/sharded_jit_demo.py

# Two pytest-xdist workers, one per core; `loadgroup` keeps the tests that share a
# module's setup (a reference run, say) on one worker (conftest.py groups them).
WORKERS ?= -n 2 --dist loadgroup

# The full suite, as CI runs it; it ends with its 25 slowest tests.
test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(WORKERS) --durations=25

# The edit-test loop: no test that starts a process (conftest.py fails one that
# does without the marker), no long training run.
test-fast: $(BIN)/.installed
	$(BIN)/ruff check .
	SPMD_TEST_TIER=fast $(BIN)/python -m pytest $(WORKERS) -q -m "not multiprocess and not slow" --durations=15

# The tests that mean something only on a TPU (tests/tpu), in one process, as
# that machine's own python3 runs them (after `eval "$$(benchmarks/tpu_setup.sh)"`;
# no venv there). Where the venv exists (a development machine) its python runs
# them, since the system python3 there has no JAX. --confcutdir leaves out the
# suite's conftest.py, which pins JAX to CPU devices; elsewhere these tests skip,
# saying why.
TPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
test-tpu:
	PYTHONUNBUFFERED=1 $(TPU_PYTHON) -m pytest -p no:cacheprovider --confcutdir=tests/tpu -v -s -rA tests/tpu

# The whole fault suite (CI runs a subset of the same tests); the table lands in
# workdir/faults/report.md.
faults: $(BIN)/.installed
	SPMD_FAULTS=full $(BIN)/python -m pytest $(WORKERS) tests/faults -m faults
	cat workdir/faults/report.md

# Every performance figure (P1-P10) in one run; the table lands in
# workdir/bench/results.md (BENCH_ARGS=--update-readme also updates the README and docs/performance.md).
bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
