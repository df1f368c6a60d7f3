PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test test-all bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: setup.py pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -U pip
	# torch==2.13.0 first: on CPU machines it resolves to the local CPU build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,megatron-lm]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	mkdir -p out
	$(BIN)/deadpool demo --summary-json out/demo.json

test: venv
	bash scripts/run_tests.sh

test-all: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

bench: venv
	mkdir -p out
	$(BIN)/deadpool bench overhead --json out/overhead.json
	$(BIN)/deadpool bench recovery --json out/recovery.json

clean:
	rm -rf $(VENV) out *.egg-info
