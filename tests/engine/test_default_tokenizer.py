"""The default model's directory holds its byte-level tokenizer in Hugging Face's format: transformers
loads it and counts the same ids as the engine's ByteTokenizer; directories built before get it added."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hybridkv.engine.default_model import ensure_default_model
from hybridkv.engine.tokenizer import ByteTokenizer, HFTokenizer, SpecialTokens, load_tokenizer

TEXTS = ["Hello, world", "é漢字 \n\t  x", "", "  leading spaces", "emoji 🙂 and \x00 nul"]


def test_saved_tokenizer_equals_the_byte_tokenizer(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = ensure_default_model(tmp_path)
    assert isinstance(load_tokenizer(model_dir), ByteTokenizer)  # the engine keeps its own (marked byte-level)
    ours, hf = ByteTokenizer(), HFTokenizer(model_dir / "tokenizer.json")
    auto = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (2, 1, 0)
    for text in TEXTS:
        assert hf.encode(text) == ours.encode(text) == auto(text).input_ids
        assert hf.encode_continuation(text) == ours.encode_continuation(text)
    rng = random.Random(0)
    for _ in range(20):  # any id sequence, invalid UTF-8 included, decodes alike
        ids = [rng.randrange(0, 259) for _ in range(rng.randrange(1, 40))]
        assert hf.decode(ids) == ours.decode(ids) == auto.decode(ids, skip_special_tokens=True)
        assert hf.decode(ids, SpecialTokens.KEEP) == ours.decode(ids, SpecialTokens.KEEP)


def test_a_directory_built_before_gets_the_tokenizer(tmp_path: Path) -> None:
    model_dir = ensure_default_model(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()
    assert ensure_default_model(tmp_path) == model_dir
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / "tokenizer_config.json").is_file()
