"""Nothing in the package imports `hybridkv.integrations` (its modules need optional extras such as vLLM)."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridkv

PACKAGE = Path(hybridkv.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_module_outside_integrations_imports_them() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "integrations" in path.parents:
            continue
        if any(name == "hybridkv.integrations" or name.startswith("hybridkv.integrations.")
               for name in imported_modules(path)):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []
    assert (PACKAGE / "integrations" / "vllm.py").exists()  # the scan looked at the right package
