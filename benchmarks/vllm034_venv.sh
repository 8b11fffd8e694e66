#!/usr/bin/env bash
# A venv in which vLLM 0.34's v1 core imports (no model, no GPU): vllm 0.34.0 without its dependency
# resolution (it would pull CUDA wheels), torch 2.13.0 CPU, and the pure-Python modules its config,
# request and scheduler modules import (pip warns that 0.34 pins torch 2.14; the v1 core runs on 2.13).
#   bash benchmarks/vllm034_venv.sh [DIR]     # DIR: ~/.cache/hybridkv-bench/vllm034-venv
# Used by tests/engine/test_windowed_admission.py (live check; skipped without it) and
# benchmarks/vllm_admission_driver.py.
set -euo pipefail
venv=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridkv-bench/vllm034-venv}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm.v1.core.sched.scheduler" 2>/dev/null; then
  echo "$venv: ready"; exit 0
fi
python3 -m venv "$venv"
pip="$venv/bin/python -m pip install -q"
$pip torch==2.13.0
$pip --no-deps vllm==0.34.0
$pip numpy packaging regex psutil pyzmq msgspec pydantic cbor2 'transformers>=5.16.1' aiohttp requests openai pillow \
     pybase64 cachetools cloudpickle uvloop py-cpuinfo prometheus_client fastapi partial_json_parser xxhash \
     llguidance xgrammar
"$venv/bin/python" -m pip uninstall -q -y triton 2>/dev/null || true   # a CUDA-only import that breaks on CPU
echo "$venv: ready"
