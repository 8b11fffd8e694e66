"""bench_hits_scale.py on a small Mooncake trace: its runs equal `hybridkv simulate` black-box; its cell, the ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.bench_hits_scale import main
from hybridkv.cli import app

#: four requests over two 512-token segments shared by all and one shared by the last two
TRACE = [{"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]},
         {"timestamp": 50, "input_length": 1300, "output_length": 20, "hash_ids": [1, 2, 4]},
         {"timestamp": 4000, "input_length": 1600, "output_length": 20, "hash_ids": [1, 2, 5, 6]},
         {"timestamp": 8000, "input_length": 1700, "output_length": 20, "hash_ids": [1, 2, 5, 7]}]


def test_bench_hits_scale_runs_equal_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    assert main(["--trace", str(path), "--layouts", "mamba2", "--budgets", "64GiB"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [dict(field.split("=", 1) for field in line.split()) for line in lines if line.startswith("layout=")]
    hits = {row["setting"]: int(row["hits"]) for row in rows}
    cli = {}
    for preset in ("hybridkv", "vllm"):
        out = CliRunner().invoke(app, ["simulate", "nemotron-nano-9b-v2", "--trace", str(path), "--preset", preset,
                                       "--memory-gib", "64", "--max-model-len", "32768", "--json"])
        assert out.exit_code == 0, out.output
        cli[preset] = json.loads(out.output)["hit_tokens"]
    # the preset is bench_hits.OURS; vLLM's default (dense retention) is the first of vLLM's settings
    assert (hits["ours"], hits["retention_None"]) == (cli["hybridkv"], cli["vllm"])
    best = max(h for name, h in hits.items() if name != "ours")
    cell = next(line for line in lines if line.startswith("CELL "))
    assert f"ours={hits['ours']} vllm_best={best} ratio={(hits['ours'] + 1) / (best + 1):.3f}" in cell
    assert lines[-1].startswith(f"min_cell_vs_vllm={(hits['ours'] + 1) / (best + 1):.3f} layout=mamba2 budget=64GiB")
