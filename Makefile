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
	$(VENV)/bin/hybridkv plan gpt-oss-20b gemma-3-27b gemma-3n-e4b gemma-4-31b llama-4-scout qwen3-next-80b qwen3.5-0.8b jamba-mini granite-4.0-h-tiny falcon-h1-7b

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
