"""The engine's public surface: options, errors, sampler, tokenizer, workload files, default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.llm import LLM, resolve_model_dir
from hybridkv.engine.models.registry import model_class
from hybridkv.engine.sampler import EosMode, SamplingParams, filtered_logits, sample
from hybridkv.engine.tokenizer import ByteTokenizer
from hybridkv.errors import CapacityError, ConfigError, UnsupportedModelError
from hybridkv.scheduling.workload import Conversation, load_jsonl, rounds


def test_unknown_llm_option_is_rejected_with_the_valid_ones_listed() -> None:
    with pytest.raises(ConfigError, match=r"unknown engine option.*'max_batch'.*max_num_batched_tokens"):
        LLM(max_batch=3)


@pytest.mark.parametrize(("name", "value"), [("max_num_seqs", 0), ("block_size", -16), ("dtype", "int8"),
                                              ("prefix_caching", "sometimes"), ("kv_cache_memory_gib", 0)])
def test_invalid_engine_options_raise_config_error(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name if name != "prefix_caching" else "prefix_caching"):
        EngineConfig.from_options({name: value})


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match=r"FooForCausalLM.*Gemma3ForCausalLM.*GptOssForCausalLM"):
        model_class({"architectures": ["FooForCausalLM"], "model_type": "foo"})


def test_a_catalog_name_explains_that_the_catalog_has_no_weights() -> None:
    with pytest.raises(ConfigError, match="catalog entry"):
        resolve_model_dir("google/gemma-3-27b-it")


def test_sampler_greedy_top_k_and_seeds() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0], [3.0, 0.0, 0.0, 0.0]])
    greedy = SamplingParams()
    assert sample(logits, [greedy, greedy], [torch.Generator(), torch.Generator()]) == [1, 0]
    top1 = SamplingParams(temperature=2.0, top_k=1)
    assert sample(logits, [top1, top1], [torch.Generator(), torch.Generator()]) == [1, 0]
    hot = SamplingParams(temperature=5.0, seed=3)
    draws = [sample(logits[:1].repeat(64, 1), [hot] * 64, [torch.Generator().manual_seed(s) for s in range(64)])
             for _ in range(2)]
    assert draws[0] == draws[1]  # same seeds, same tokens
    assert len(set(draws[0])) > 1  # and a hot temperature does explore


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.tensor([[5.0, 4.0, -5.0, -5.0]])  # p = 0.73, 0.27, ~0, ~0
    nucleus = SamplingParams(temperature=1.0, top_p=0.5)
    tokens = {sample(logits, [nucleus], [torch.Generator().manual_seed(s)])[0] for s in range(32)}
    assert tokens == {0}


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2),
                                 dict(logprobs=-1), dict(top_k=1.5), dict(logprobs=True), dict(temperature="hot"),
                                 dict(top_p=None), dict(seed=1.5)])
def test_invalid_sampling_params_raise(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == 2 and tok.decode(ids) == "héllo ✓"
    assert tok.encode_continuation("a") == [ord("a") + 3]


def test_workload_file_sessions_become_rounds_that_extend_history(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    lines = [{"session": "a", "prompt": "hi"}, {"prompt_token_ids": [2, 9]}, {"session": "a", "prompt": "more"},
             {"session": "b", "prompt": "yo", "max_tokens": 3}]
    path.write_text("# comment\n" + "\n".join(json.dumps(x) for x in lines) + "\n")
    turns = load_jsonl(path)
    assert [[t.session for t in r] for r in rounds(turns)] == [["a", None, "b"], ["a"]]
    tok = ByteTokenizer()
    conv = Conversation(tok.encode, tok.encode_continuation)
    first = conv.prompt(turns[0])
    conv.record(turns[0], first, [50, 51])
    assert conv.prompt(turns[2]) == [*first, 50, 51, *tok.encode_continuation("more")]


@pytest.mark.parametrize(("line", "message"), [("[1]", "expected a JSON object"), ('{"prompt": ""}', "non-empty"),
                                               ('{"text": "x"}', "unknown field"), ("{", "not valid JSON"),
                                               ('{"prompt": "x", "max_tokens": 0}', "max_tokens")])
def test_bad_workload_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"line 2.*{message}"):
        load_jsonl(path)


def test_default_model_is_built_once_and_generates_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    llm = LLM(max_model_len=256, kv_cache_memory_gib=0.01)
    out = llm.generate(["Hello, world"], SamplingParams(max_tokens=5, eos=EosMode.IGNORE))[0]
    assert len(out.token_ids) == 5 and isinstance(out.text, str)
    assert out.prompt_token_ids == ByteTokenizer().encode("Hello, world")
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and (built[0] / "model.safetensors").is_file()
    again = LLM(max_model_len=256, kv_cache_memory_gib=0.01)  # reuses the cached weights
    assert again.generate(["Hello, world"], SamplingParams(max_tokens=5, eos=EosMode.IGNORE))[0].token_ids == \
        out.token_ids
    with pytest.raises(ConfigError, match="token ids must lie in"):
        llm.generate([[5, 100000]])


def test_bad_prompts_name_the_prompt_and_a_failed_call_leaves_the_engine_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    llm = LLM(max_model_len=256, kv_cache_memory_gib=0.0001, max_num_batched_tokens=64)  # 13 blocks
    few = SamplingParams(max_tokens=2, eos=EosMode.IGNORE)
    with pytest.raises(ConfigError, match="single str"):
        llm.generate("Hello", few)
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        llm.generate(["ok", []], few)
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        llm.generate([[]], few)
    with pytest.raises(ConfigError, match=r"prompt 0 must be a str or a sequence of int token ids, got 5"):
        llm.generate([5], few)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"prompt 0 must be a str or a sequence of int token ids"):
        llm.generate([[5, 1.5]], few)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"token ids must lie in \[0, 259\), got min -1"):
        llm.generate([[5, -1]], few)
    with pytest.raises(ConfigError, match=r"prompt 0 has 257 tokens; expected at most max_model_len 256 "
                                          r"\(the model allows up to 4096\)"):
        llm.generate([[5] * 257], few)
    with pytest.raises(ConfigError, match="at most the vocabulary size 259"):
        llm.generate([[5]], SamplingParams(max_tokens=1, logprobs=1000))
    with pytest.raises(CapacityError):  # 256 tokens do not fit this tiny cache
        llm.generate([[5] * 256], few)
    assert not llm.scheduler.has_unfinished  # the failed request was dropped with its blocks
    assert llm.manager.usage() == 0.0
    out = llm.generate([[5, 6, 7]], few)[0]
    assert len(out.token_ids) == 2


def test_temperature_top_k_top_p_keep_the_same_tokens_as_transformers() -> None:
    warpers = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        vocab = int(torch.randint(2, 40, (1,), generator=gen))
        logits = torch.randn(vocab, generator=gen) * 3
        if trial % 3 == 0:
            logits = torch.round(logits)  # ties at the top-k / top-p boundary
        temperature = float(torch.rand(1, generator=gen)) * 2 + 0.1
        top_k = int(torch.randint(0, vocab + 2, (1,), generator=gen))
        top_p = float(torch.rand(1, generator=gen)) * 0.99 + 0.01 if trial % 4 else 1.0
        ours = filtered_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        ref = warpers.TemperatureLogitsWarper(temperature)(None, logits[None].clone())
        if top_k:
            ref = warpers.TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1.0:
            ref = warpers.TopPLogitsWarper(top_p)(None, ref)
        kept, ref_kept = ours[ours > float("-inf")], ref[0][ref[0] > float("-inf")]
        # the same multiset of kept logits (which of two equal logits survives a cut may differ)
        assert torch.equal(torch.sort(kept).values, torch.sort(ref_kept).values), (trial, top_k, top_p)


def test_a_seeded_request_draws_the_same_tokens_alone_or_in_a_batch() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.3, top_p=0.9, top_k=20)] * 6
    batch = sample(logits, params, [torch.Generator().manual_seed(100 + i) for i in range(6)])
    alone = [sample(logits[i : i + 1], params[:1], [torch.Generator().manual_seed(100 + i)])[0] for i in range(6)]
    assert batch == alone
