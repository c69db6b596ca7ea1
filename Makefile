# Two set-up commands: `make demo` and `make test`. Both create (or reuse) .venv and install flashtile.
# On a machine without a GPU, TORCH_SPEC pins the CPU build that lies on disk; an unpinned torch
# would download several GB of CUDA wheels. Override it (e.g. TORCH_SPEC=torch) on a GPU machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# test processes (pytest-xdist): the CI machine has 2 cores. --dist loadfile: one worker runs a whole file, so module
# fixtures (the sm_90 compile, the CPU bench run) run once instead of once per worker.
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flashtile-installed

.PHONY: demo test clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

demo: $(STAMP)
	$(PY) -m flashtile demo

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
