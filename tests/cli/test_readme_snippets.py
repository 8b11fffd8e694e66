"""Every ```python block of README.md and docs/*.md runs as written (each in a fresh namespace).

The one exception is explicit: a block whose first line is `# needs: ...` names the outside
service it talks to (a running `hybridkv server`); it is compiled, not run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{doc.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = _blocks()


def test_the_docs_have_python_blocks() -> None:
    assert {where.split(":")[0] for where, _ in BLOCKS} >= {"README.md", "docs/kv_cache_manager.md"}


@pytest.mark.slow
@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_snippet_runs(where: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    if code.startswith("# needs:"):
        compile(code, where, "exec")  # it must at least be valid Python
        return
    if "hybridkv.engine" in code:
        pytest.importorskip("torch")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))  # the default model, if a snippet builds it
    exec(compile(code, where, "exec"), {"__name__": "__snippet__"})
