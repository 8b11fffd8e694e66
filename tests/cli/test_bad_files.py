"""`hybridkv plan` and `simulate` on hostile files (issue 46, items 15-23): each is one `error:` line
naming the field, the value and what is allowed, exit code 2, no traceback, in bounded time; a prompt
or an output cut for --max-model-len is said (stderr and --json)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()
TINY = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "float32", "vocab_size": 259,
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16, "max_position_embeddings": 65536,
    "layer_types": ["sliding_attention", "full_attention"],
}


def one_line_error(args: list[str], *words: str, seconds: float = 10.0) -> str:
    t0 = time.monotonic()
    result = runner.invoke(app, args)
    assert time.monotonic() - t0 < seconds
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("layers", [10**9, 10**30])
def test_item15_a_huge_layer_count(tmp_path: Path, layers: int) -> None:
    one_line_error(["plan", config(tmp_path, json.dumps({**TINY, "num_hidden_layers": layers}))],
                   "'num_hidden_layers' must be at most 10000", f"got {str(layers)[:10]}")


@pytest.mark.parametrize("where", ["text_config", "any_value"])
def test_item16_deep_nesting(tmp_path: Path, where: str) -> None:
    depth = 2000 if where == "text_config" else 100_000
    deep = "[" * depth + "]" * depth
    text = json.dumps({**TINY, "extra": 0})[:-1] + f', "{where}": {deep}' + "}"
    one_line_error(["plan", config(tmp_path, text)], "nests deeper than 64 levels")


def test_item17_a_window_of_1e308(tmp_path: Path) -> None:
    text = json.dumps(TINY).replace('"sliding_window": 16', '"sliding_window": 1e308')
    one_line_error(["plan", config(tmp_path, text)], "'sliding_window' must be at most 1099511627776")


def test_a_nan_in_a_config(tmp_path: Path) -> None:
    text = json.dumps(TINY).replace('"sliding_window": 16', '"sliding_window": NaN')
    one_line_error(["plan", config(tmp_path, text)], "NaN is not a number JSON allows")


def trace(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def simulate(tmp_path: Path, trace_file: str, *extra: str) -> list[str]:
    return ["simulate", config(tmp_path, json.dumps(TINY)), "--trace", trace_file, "--memory-gib", "0.01", *extra]


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}'


@pytest.mark.parametrize(("line", "words"), [
    ('{"timestamp": NaN, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}',
     ["trace line 2", "NaN is not a number JSON allows"]),  # item 18: it never ended
    ('{"timestamp": Infinity, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}',
     ["trace line 2", "Infinity is not a number"]),  # item 19
    ('{"timestamp": 0, "input_length": 600, "output_length": Infinity, "hash_ids": [1, 2]}',
     ["Infinity is not a number"]),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1e999, "hash_ids": [1, 2]}',
     ["1e999 overflows a float"]),
    (f'{{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, {2**70}]}}',
     ["'hash_ids' holds 1180591620717411303424", "[0, 2**32)"]),  # item 20
    (json.dumps({"timestamp": 0, "input_length": 200_000 * 512, "output_length": 4,
                 "hash_ids": list(range(200_000))}),
     ["'input_length' must be a number in [0, 4194304], got 102400000"]),  # item 21
])
def test_items18_to_21_bad_mooncake_lines(tmp_path: Path, line: str, words: list[str]) -> None:
    one_line_error(simulate(tmp_path, trace(tmp_path, GOOD, line)), *words)


def test_item20_a_huge_token_id(tmp_path: Path) -> None:
    one_line_error(simulate(tmp_path, trace(tmp_path, json.dumps({"prompt_token_ids": [1, 10**30]}))),
                   "workload line 1", "'prompt_token_ids' holds 1000000000000000000000000000000", "[0, 2**31)")


def test_item22_a_huge_trace_block(tmp_path: Path) -> None:
    one_line_error(simulate(tmp_path, trace(tmp_path, GOOD), "--trace-block-tokens", "1000000000"),
                   "--trace-block-tokens must be an integer in [1, 1048576], got 1000000000")


def test_item23_cuts_for_max_model_len_are_said(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt_token_ids": list(range(40_000)), "max_tokens": 1}),
             json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 10**12})]
    result = runner.invoke(app, [*simulate(tmp_path, trace(tmp_path, *lines), "--max-model-len", "32768",
                                           "--memory-gib", "0.05"), "--json"])
    assert result.exit_code == 0, result.output
    assert ("note: --max-model-len 32768: 1 prompt(s) cut to 32767 tokens (the longest had 40000); 1 output(s) "
            "stopped at 32768 tokens of sequence (the largest asked for 1000000000000 tokens)") in result.stderr
    cuts = json.loads(result.stdout)["length_cuts"]
    assert cuts == {"max_model_len": 32768, "prompts_cut": 1, "longest_prompt_tokens": 40000, "outputs_capped": 1,
                    "largest_output_tokens": 10**12}
