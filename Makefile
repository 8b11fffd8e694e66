# Quick start: `make run` (the main job on its embedded defaults) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[engine,dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hybridkv run

lint: $(STAMP)
	$(VENV)/bin/ruff check hybridkv tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest

test: lint typecheck unit

bench: $(STAMP)
	$(PY) benchmarks/bench_manager.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
