# `make test` and `make demo` are all the set-up a fresh clone needs: they
# create .venv on first use and reinstall when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo demo-compressors lint docs bench accelerator-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,docs]"
	touch $(STAMP)

# The documentation site (docs/*.md and the API reference from the
# docstrings) into docs/_build/html, warnings as errors. -E reads every page
# at every build: an incremental build would not repeat an unchanged page's
# warnings.
docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

lint: $(STAMP)
	$(PY) -m ruff check jaxcomp experiments tests colab
	$(PY) -m ruff format --check jaxcomp experiments tests colab

# The second run repeats a representative part of the conformance suite with
# jax_enable_x64 set for the whole process (float64 by default, as in much
# scientific code): liveness and the exchange under shard_map. (Nothing lost
# in float32 and float64 under x64 is test_x64_every_compressor_nothing_lost.)
X64_TESTS := (liveness or (shard_map_matches and \
	(ldte_bs or top_k or random_k or qsgd_ef or onebit))) and not x64

# Two pytest runs, so no worker process compiles the whole suite's ~10^4 programs:
# the compressor-by-compressor files first, then the rest (a worker that had
# compiled most of the suite crashed twice inside XLA's compiler, in different tests).
UNIT_FILES := tests/test_conformance.py tests/test_selectors.py tests/test_kernels.py \
	tests/test_validation.py

# tests/conftest.py compiles with XLA:CPU's classic fusion emitter (half the
# suite's time); the last tier runs under XLA's default codegen, as users do:
# the tests marked default_codegen (bit equality across separately compiled
# kernels), those marked both_codegens (nothing lost, one compressor per
# error-feedback family) and the x64 tier.
DEFAULT_CODEGEN := JAXCOMP_TEST_CODEGEN=default

# tests/conftest.py keeps JAX's persistent compilation cache here; every
# `make test` starts it empty, so a run's time does not depend on the last one.
TEST_CACHE := .pytest_cache/jax

test: $(STAMP) lint docs
	rm -rf $(TEST_CACHE)
	$(PY) -m pytest -q -n 2 --durations=10 $(UNIT_FILES)
	$(PY) -m pytest -q -n 2 --durations=30 tests $(addprefix --ignore=,$(UNIT_FILES))
	$(DEFAULT_CODEGEN) $(PY) -m pytest -q -n 2 -m "default_codegen or both_codegens" tests
	$(DEFAULT_CODEGEN) JAX_ENABLE_X64=1 $(PY) -m pytest -q -n 2 tests/test_conformance.py \
		-k "$(X64_TESTS)"

demo: $(STAMP)
	$(PY) -m experiments.demo_training

demo-compressors: $(STAMP)
	$(PY) -m experiments.demo

bench: $(STAMP)
	$(PY) -m experiments.bench_selection

# On whatever backend JAX finds (install jax[cuda12] or jax[tpu] into .venv first):
# every compressor against the host CPU, selection, model trees, training, overlap.
# docs/accelerators.md describes the parts and the JSON.
accelerator-check: $(STAMP)
	$(PY) -m experiments.accelerator_check

clean:
	rm -rf $(VENV) build *.egg-info $(TEST_CACHE) docs/_build docs/api
