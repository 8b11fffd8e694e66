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

PREFIX = tuple(range(1000, 1208))  # 208 tokens = 13 blocks of 16; one-page blocks are 544 tokens


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
    # multi page: A's prefill ends on the block boundary 208 (align mode), so its state checkpoint
    # (34 pages in each of 3 GDN groups) and 13 attention blocks are cached: B hits all 208 tokens
    assert qwen35_hits(StateLayout.MULTI_PAGE) == (208, (0, 208))


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
    assert hits == {"one_page": 0, "multi_page": 208}


def test_one_running_state_hits_the_same_and_counts_its_copies(tmp_path: Path) -> None:
    """`--running-state fixed`: B hits the same 208 tokens. Copies, in pages (3 GDN groups x 34 pages =
    102 per state): A's chunks end at 192 and 208 (align mode), each copied out into a checkpoint (204);
    B's hit is copied into its running state (102), its chunk [208, 240) copied out at 240 (102)."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": list(r.new_tokens), "max_tokens": 1}) + "\n"
                            for r in trace()))
    out = CliRunner().invoke(app, ["simulate", "Qwen/Qwen3.5-0.8B", "--trace", str(path), "--memory-gib", "1",
                                   "--max-model-len", "1024", "--state-layout", "multi_page",
                                   "--running-state", "fixed", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert (report["hit_tokens"], report["request_hits"]) == (208, [0, 208])
    assert (report["block_copies"], report["checkpoint_copies"], report["checkpoints_skipped"]) == (102, 306, 0)
    text = CliRunner().invoke(app, ["simulate", "Qwen/Qwen3.5-0.8B", "--trace", str(path), "--memory-gib", "1",
                                    "--max-model-len", "1024", "--state-layout", "multi_page",
                                    "--running-state", "fixed"]).output
    assert "state checkpoints copied / skipped" in text and "306 / 0" in text
