"""`hybridkv plan --plot`: the CLI writes a PNG, and the plotted numbers match hand arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.cli.plan_plot import DEFAULT_LENGTHS_TOKENS, capacity_curves
from hybridkv.cli.plan_report import PlanRequest

GIB = 1024**3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
runner = CliRunner()


def test_cli_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "p.png"
    result = runner.invoke(app, ["plan", "gpt-oss-20b", "qwen3-next-80b", "--memory-gib", "16", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip().endswith(f"wrote {out}")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert 10_000 < len(data) < 2_000_000


def test_json_stays_valid_with_plot(tmp_path: Path) -> None:
    out = tmp_path / "q.png"
    result = runner.invoke(app, ["plan", "gpt-oss-20b", "--memory-gib", "16", "--json", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == "openai/gpt-oss-20b"
    assert f"wrote {out}" in result.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("length", [1024, 32768])
def test_gpt_oss_20b_curve_by_hand(length: int) -> None:
    (curve,) = capacity_curves([PlanRequest(model="gpt-oss-20b", memory_gib=16)])
    assert curve.name == "gpt-oss-20b"
    assert curve.lengths_tokens == DEFAULT_LENGTHS_TOKENS  # 1K..128K, all within its 131072 limit
    i = curve.lengths_tokens.index(length)
    # 24 layers alternating sliding (128) / full; 8 KV heads x 64, bf16: page at block 16 = 32768 bytes.
    page = 16 * 2 * 8 * 64 * 2
    num_blocks = 16 * GIB // page // 12  # group_size 12, 2 groups
    need = math.ceil(length / 16) + math.ceil(min(127 + 2048, length) / 16) + 1
    assert curve.hybrid[i] == pytest.approx((num_blocks - 1) / need)
    uniform_blocks = 16 * GIB // (24 * page)
    assert curve.uniform is not None
    assert curve.uniform[i] == pytest.approx((uniform_blocks - 1) / math.ceil(length / 16))


def test_mamba_hybrid_has_no_uniform_curve_and_lengths_cap_at_the_model_limit() -> None:
    qwen, qwen3 = capacity_curves([PlanRequest(model="qwen3-next-80b", memory_gib=16),
                                   PlanRequest(model="qwen3-8b", memory_gib=16)])
    assert qwen.uniform is None and len(qwen.hybrid) == len(DEFAULT_LENGTHS_TOKENS)
    assert all(c > 0 for c in qwen.hybrid)
    assert qwen3.lengths_tokens[-1] == 40960  # its max_position_embeddings, below 64K
    assert qwen3.uniform is not None


def test_plan_without_plot_does_not_import_matplotlib() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from hybridkv.cli import app\n"
        "r = CliRunner().invoke(app, ['plan', 'gpt-oss-20b', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('matplotlib' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
