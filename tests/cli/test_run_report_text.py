"""`hybridkv run`'s summary says what each figure counts (a first-time reader's questions, issue 26)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from hybridkv.cli.run import _render

MIB = 1 << 20


def _report(*, passes: int, repeated: int, server: bool) -> dict[str, Any]:
    per_pass = {"pass": 1, "prompt_tokens": 8150, "local_hit_tokens": 6880, "external_hit_tokens": 0,
                "computed_prefill_tokens": 1270, "mean_ttft_s": 0.1}
    report: dict[str, Any] = {
        "model": "default-gemma3", "requests": 18 * passes, "rounds": 3,
        "passes": [{**per_pass, "pass": i + 1} for i in range(passes)], "prompt_tokens": 8150 * passes,
        "generated_tokens": 576 * passes, "generated_tok_per_s": 200.0, "total_tok_per_s": 3000.0,
        "mean_ttft_s": 0.1, "max_ttft_s": 0.3, "steps": 207, "preemptions": 0,
        "totals": {"external_hit_tokens": 2736, "computed_prefill_tokens": 1420},
        "config": {"max_model_len": 4096}, "outputs_identical_across_passes": True if passes > 1 else None,
        "prefix_cache": {"hit_rate": 0.745, "hit_tokens": 12144, "prompt_tokens": 16300, "groups": [],
                         "repeated_lookups": {"lookups": repeated, "query_tokens": 6811, "hit_tokens": 4400}},
        "kv_memory": {"allocated_bytes": 256 * MIB, "planned_bytes": 256 * MIB, "peak_used_bytes": 2 * MIB,
                      "peak_unshared_bytes": 3 * MIB, "uniform_layout_bytes_for_same_tokens": 9 * MIB,
                      "prefix_sharing_saving": 0.28, "layout_saving": 0.64, "max_concurrency": 35.58,
                      "uniform_max_concurrency": 21.33},
    }
    if server:
        report["kv_server"] = {"url": "tcp://127.0.0.1:1", "started_for_this_run": True, "reachable": True,
                               "chunk_tokens": 16,
                               "object_groups": [], "stored_chunks": 1, "loads": 1, "failed_loads": 0, "errors": 0}
    return report


def _text(report: dict[str, Any]) -> str:
    out = io.StringIO()
    _render(Console(file=out, width=120), report)
    return " ".join(out.getvalue().split())


def test_the_summary_names_passes_turns_lengths_and_why_lookups_repeat() -> None:
    text = _text(_report(passes=2, repeated=15, server=True))
    assert "requests │ 18 per pass x 2 passes = 36" in text and "rounds" in text
    assert "rounds per pass │ 3 (one per turn)" in text
    assert "KV cache server hits │ 2736 prompt tokens loaded │" in text  # no "computed" on this row
    assert "prompt tokens computed │ 1420 (in neither cache)" in text
    assert "max concurrency at 4096 tokens │ hybrid 35.58 / uniform 21.33" in text
    assert "lookups repeated (see below) │ 15 lookups of 6811 tokens, 4400 hit" in text
    assert "a request that waited for KV cache room, or was preempted, is looked up again" in text
    alone = _text(_report(passes=1, repeated=0, server=False))
    assert "requests │ 18 │" in alone and "lookups repeated" not in alone and "server hits" not in alone
