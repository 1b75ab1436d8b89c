# tracestore — the two commands of the README: `make train` (the main job) and `make test`.
# Both create .venv on first use and install the package with its extras
# (torch is pinned to the CPU build that pip finds locally: a bare `torch`
# requirement would pull a multi-GB CUDA build).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# worker processes of `make test` (pytest-xdist); PYTEST_WORKERS=0 runs the suite in one process
PYTEST_WORKERS ?= 2

.PHONY: install train demo test test-model-long fuzz lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[ray,gateway,dev]"
	touch $(STAMP)

install: $(STAMP)

## The main job on the embedded default server: a short run of the reference RL trainer,
## its agents calling a session gateway over HTTP with the openai SDK (--agents local: in process).
train: $(STAMP)
	$(VENV)/bin/tracestore train --agents http --gateways 2

## The scripted tour of every part, one table each.
demo: $(STAMP)
	$(VENV)/bin/tracestore demo

## The full test suite (starts its own servers; Debian redis-server and Docker are used when present).
test: $(STAMP)
	$(VENV)/bin/ruff check tracestore trainer tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

## The trace model test's long random profile (not part of `make test`, which runs its
## fixed-seed profile): 3,000 random programs per backend, up to an hour; a failure prints
## how to replay it (PYTEST_ARGS=--hypothesis-seed=N replays a seed).
test-model-long: $(STAMP)
	TRACESTORE_MODEL_PROFILE=long $(VENV)/bin/pytest tests/test_traces_model.py --timeout=7200 $(PYTEST_ARGS)

## The long fuzz of the public API (make test runs a short fixed-seed one); counts in fuzz-report.json.
fuzz: $(STAMP)
	rm -f fuzz-report.json
	TRACESTORE_FUZZ=long TRACESTORE_FUZZ_REPORT=fuzz-report.json $(VENV)/bin/pytest tests/test_fuzz.py -q --timeout 0
	cat fuzz-report.json

lint: $(STAMP)
	$(VENV)/bin/ruff check tracestore trainer tests benchmarks
	$(VENV)/bin/mypy

## Benchmarks (not part of the test suite); figures go to benchmarks/results/.
bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
