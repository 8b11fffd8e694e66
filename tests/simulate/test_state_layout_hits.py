"""Prefix hits of Qwen3.5-0.8B's two state layouts (`--state-layout`), worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from hybridkv.catalog import find
from hybridkv.cli import app
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import GIB, PlannerOptions, StateLayout, plan
from hybridkv.simulate.simulator import SimOptions, simulate
from hybridkv.simulate.trace import TraceRequest

PREFIX = tuple(range(1000, 1208))  # 208 tokens = 6 multi-page blocks of 32 + 16; one-page blocks are 544 tokens


def trace() -> list[TraceRequest]:
    """A: the 208-token prefix alone; B, after A finished: the prefix and 40 tokens of its own."""
    return [TraceRequest(arrival_ms=0, new_tokens=PREFIX, output_tokens=1),
            TraceRequest(arrival_ms=60_000, new_tokens=PREFIX + tuple(range(5000, 5040)), output_tokens=1)]


def qwen35_hits(layout: StateLayout) -> tuple[int, tuple[int, ...]]:
    entry = find("Qwen/Qwen3.5-0.8B")
    assert entry is not None
    config = plan(model_spec_from_config(entry.config, name=entry.hf_id),
                  PlannerOptions(memory_bytes=GIB, max_model_len=1024, state_layout=layout)).config
    report = simulate(trace(), config, SimOptions(max_model_len=1024))
    return report.hit_tokens, report.request_hits


def test_a_short_shared_prefix_hits_only_with_multi_page_states() -> None:
    # one page: a 544-token block is never full within 248 tokens, so nothing is cached at all
    assert qwen35_hits(StateLayout.ONE_PAGE) == (0, (0, 0))
    # multi page (32-token blocks: a state spans 17 pages): A's first chunk stops at 192, the last block
    # boundary before its end (align mode), so its state checkpoint (17 pages in each of 3 GDN groups) and
    # 6 attention blocks are cached there; [192, 208) fills no block: B hits 192 tokens
    assert qwen35_hits(StateLayout.MULTI_PAGE) == (192, (0, 192))


def test_simulate_cli_takes_the_state_layout(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": list(r.new_tokens), "max_tokens": 1}) + "\n"
                            for r in trace()))
    hits = {}
    for layout in ("one_page", "multi_page"):
        out = CliRunner().invoke(app, ["simulate", "Qwen/Qwen3.5-0.8B", "--trace", str(path), "--memory-gib", "1",
                                       "--max-model-len", "1024", "--max-num-seqs", "1", "--state-layout", layout,
                                       "--json"])
        assert out.exit_code == 0, out.output
        hits[layout] = json.loads(out.output)["hit_tokens"]
    assert hits == {"one_page": 0, "multi_page": 192}


def test_one_running_state_hits_the_same_and_counts_its_copies(tmp_path: Path) -> None:
    """`--running-state fixed`: B hits the same 192 tokens. Copies, in pages (3 GDN groups x 17 pages =
    51 per state): A's chunks end at 192 (a block boundary: copied out into a checkpoint, 51) and 208 (inside
    a block: none); B's hit is copied into its running state (51), its chunks end at 224 (the last boundary
    before its end: copied out, 51) and 248 (none)."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": list(r.new_tokens), "max_tokens": 1}) + "\n"
                            for r in trace()))
    out = CliRunner().invoke(app, ["simulate", "Qwen/Qwen3.5-0.8B", "--trace", str(path), "--memory-gib", "1",
                                   "--max-model-len", "1024", "--state-layout", "multi_page",
                                   "--running-state", "fixed", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert (report["hit_tokens"], report["request_hits"]) == (192, [0, 192])
    assert (report["block_copies"], report["checkpoint_copies"], report["checkpoints_skipped"]) == (51, 102, 0)
    text = CliRunner().invoke(app, ["simulate", "Qwen/Qwen3.5-0.8B", "--trace", str(path), "--memory-gib", "1",
                                    "--max-model-len", "1024", "--state-layout", "multi_page",
                                    "--running-state", "fixed"]).output
    assert "state checkpoints copied / skipped" in text and "102 / 0" in text
