"""The core must stay importable by any engine: importing it must not pull in torch or transformers."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import hybridkv.core

CORE_MODULES = sorted(f"hybridkv.core.{info.name}" for info in pkgutil.iter_modules(hybridkv.core.__path__))

_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""


def test_core_modules_are_discovered() -> None:
    assert "hybridkv.core.model_specs" in CORE_MODULES
    assert "hybridkv.core.specs" in CORE_MODULES


def test_importing_the_core_does_not_import_torch() -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE, *CORE_MODULES],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    heavy = json.loads(result.stdout.strip().splitlines()[-1])
    assert "torch" not in heavy and "transformers" not in heavy, f"the core imported {heavy}"
