# `make test` and `make demo` are all the set-up a fresh clone needs: they
# create .venv on first use and reinstall when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo demo-compressors lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check jaxcomp experiments tests

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --durations=15 tests

demo: $(STAMP)
	$(PY) -m experiments.demo_training

demo-compressors: $(STAMP)
	$(PY) -m experiments.demo

bench: $(STAMP)
	$(PY) -m experiments.bench_selection

clean:
	rm -rf $(VENV) build *.egg-info
