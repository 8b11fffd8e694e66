# Quick start: `make run` (the main job on its embedded defaults) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit bench clean redis-server

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[engine,dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hybridkv run --kv-server auto --passes 2

lint: $(STAMP)
	$(VENV)/bin/ruff check hybridkv tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The Valkey tier tests start their own redis-server (127.0.0.1, a free port) and need the binary:
# Debian's redis-server (valkey-server is not packaged), installed here when missing (as root).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; \
	  else \
	    echo "redis-server is missing and this is not root: run 'sudo apt-get install redis-server'" \
	         "(the Valkey tier tests skip without it, and fail under CI)"; \
	  fi

unit: $(STAMP) redis-server
	$(VENV)/bin/pytest

test: lint typecheck unit

bench: $(STAMP)
	$(PY) benchmarks/bench_manager.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
