"""`bench_engine.py --vllm-bench`'s inputs for vLLM's own tools: the word-level tokenizer and the
ShareGPT file give back exactly the benchmark's token ids; the flag needs a vLLM interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from benchmarks.vllm_bench_compare import CliJob, save_word_tokenizer, write_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_sharegpt_prompts_tokenize_back_to_the_benchmark_ids(tmp_path: Path) -> None:
    prompts = [[5, 17, 1023, 3], [10239, 0, 9999], [42] * 7]  # hand-picked ids, the vocab's last one included
    save_word_tokenizer(tmp_path, 10240)
    write_dataset(tmp_path / "prompts.json", prompts)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    entries = json.loads((tmp_path / "prompts.json").read_text())
    # vLLM's ShareGPT reader: the first turn's text, tokenized as `tokenizer(prompt).input_ids`
    assert [tokenizer(e["conversations"][0]["value"]).input_ids for e in entries] == prompts
    assert len(tokenizer) == 10240
    assert tokenizer.decode([5, 17]) == "t5 t17"


def test_vllm_commands_get_the_engine_settings_of_the_in_process_pass(tmp_path: Path) -> None:
    job = CliJob(python="py", model=tmp_path / "m", dataset=tmp_path / "d.json", num_prompts=32, new_tokens=64,
                 latency_len=2048, max_model_len=2128, max_num_batched_tokens=2048, max_num_seqs=32)
    thr, lat = job.throughput_args(tmp_path / "o.json"), job.latency_args(tmp_path / "o.json")
    assert thr[:2] == ["bench", "throughput"] and lat[:2] == ["bench", "latency"]
    for args in (thr, lat):
        flags = dict(zip(args[2::2], args[3::2], strict=False))
        assert flags["--max-num-batched-tokens"] == "2048" and flags["--dtype"] == "float32"
        assert flags["--max-model-len"] == "2128" and flags["--max-num-seqs"] == "32"
    assert thr[thr.index("--output-len") + 1] == "64" and thr[thr.index("--dataset-name") + 1] == "sharegpt"
    assert lat[lat.index("--input-len") + 1] == "2048" and lat[lat.index("--output-len") + 1] == "1"


def test_vllm_bench_without_a_vllm_interpreter_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--vllm-bench"],
                          capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)
    assert proc.returncode == 2 and "--vllm-bench runs vLLM's own tools: it needs --vllm-python PATH" in proc.stderr
