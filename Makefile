PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# core_v0.19.0 needs Python >= 3.12 (README "Supported Megatron-LM tags"): its tests run in a
# second environment. Where python3.12 comes through pyenv, name the version.
PY312 ?= $(shell python3.12 --version >/dev/null 2>&1 && echo python3.12 || echo env PYENV_VERSION=3.12.1 python3.12)
VENV312 ?= .venv312

.PHONY: venv demo test test-all bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: setup.py pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -U pip
	# torch==2.13.0 first: where pip has a local CPU wheel (this project's CI machines) it
	# resolves to that CPU build; on plain PyPI it is the CUDA build, which also runs on CPU.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,megatron-lm]"
	touch $@

$(VENV312)/.installed: setup.py pyproject.toml
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q -U pip
	# cp312: PyPI has only torch's CUDA build (about 2.7 GB with its CUDA libraries); it runs
	# on the CPU. megatron-core 0.19.0 comes with the package (setup.py).
	$(VENV312)/bin/pip install -q torch==2.13.0
	$(VENV312)/bin/pip install -q -e ".[test,megatron-lm]"
	touch $@

venv: $(VENV)/.installed $(VENV312)/.installed

demo: $(VENV)/.installed   # Python 3.11 only: the demo installs in seconds
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
	rm -rf $(VENV) $(VENV312) out *.egg-info
