"""Hypothesis fuzz of `hybridkv plan` and `simulate` inputs (issue 46): any value in any numeric field of
a config.json or a trace line (huge, negative, fractional, NaN, Infinity, overflowing, a string, a deep
list) either works (exit 0; 1 for a plan whose memory holds no request) or is one `error:` line with
exit 2, never a traceback, within bounded time and memory."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from hybridkv.cli import app
from tests.cli.test_bad_files import TINY

runner = CliRunner()
SECONDS = 10.0
PEAK_BYTES = 256 << 20

# values as JSON text, so NaN / Infinity / 1e999 / deep nesting reach the parser as a user's file would
VALUES = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e308", "1e999", "-1e999", "-0.0", "0.5", "2.0", "true", "null",
                     '"16"', "[]", "{}", "[1, 2]", "[" * 200 + "]" * 200, "[" * 5000 + "]" * 5000]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
)
CONFIG_FIELDS = sorted(k for k, v in TINY.items() if isinstance(v, int))
TRACE_FIELDS = ["timestamp", "input_length", "output_length", "hash_id"]


def check(args: list[str]) -> None:
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        result = runner.invoke(app, args)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.monotonic() - t0 < SECONDS
    assert peak < PEAK_BYTES, f"{peak} bytes at peak"
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output[-2000:])
    if result.exit_code == 1:  # `plan`'s answer that the memory holds no request: a report, not a crash
        assert "the budget holds no request" in result.output, result.output[-2000:]
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output[-2000:]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(CONFIG_FIELDS), value=VALUES)
def test_plan_any_value_in_any_numeric_field(tmp_path: Path, field: str, value: str) -> None:
    text = json.dumps({**TINY, field: "@@"}).replace('"@@"', value)
    path = tmp_path / "config.json"
    path.write_text(text)
    check(["plan", str(path)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(TRACE_FIELDS), value=VALUES,
       block=st.sampled_from(["1", "512", "1048576", "1048577", "0", "-5"]))
def test_simulate_any_value_in_any_trace_field(tmp_path: Path, field: str, value: str, block: str) -> None:
    line = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, "@@h"]}
    if field != "hash_id":
        line[field] = "@@"
    text = json.dumps(line).replace('"@@"', value).replace('"@@h"', value if field == "hash_id" else "2")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "trace.jsonl").write_text(text + "\n")
    check(["simulate", str(tmp_path / "config.json"), "--trace", str(tmp_path / "trace.jsonl"), "--memory-gib",
           "0.01", "--trace-format", "mooncake", "--trace-block-tokens", block])
