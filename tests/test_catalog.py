"""The shipped catalog of public model configs: well-formed, unambiguous and right on known facts."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.catalog import CatalogEntry, catalog, find


def _text(entry: CatalogEntry) -> dict[str, Any]:
    """The text model's config: the nested `text_config` of multimodal models, else the config."""
    nested = entry.config.get("text_config")
    return nested if isinstance(nested, dict) else entry.config


def _entry(name: str) -> CatalogEntry:
    entry = find(name)
    assert entry is not None, f"{name} is not in the catalog"
    return entry


def test_catalog_has_at_least_fourteen_models() -> None:
    assert len(catalog()) >= 14


def test_every_entry_is_well_formed() -> None:
    for entry in catalog():
        assert "/" in entry.hf_id
        assert entry.source.strip(), entry.hf_id
        assert isinstance(entry.config.get("model_type"), str), entry.hf_id
        text = _text(entry)
        assert isinstance(text.get("model_type"), str), entry.hf_id
        assert isinstance(text.get("num_hidden_layers"), int), entry.hf_id
        assert text["num_hidden_layers"] > 0, entry.hf_id
        assert isinstance(text.get("max_position_embeddings"), int), entry.hf_id
        for key in ("layer_types", "no_rope_layers"):
            if key in text:
                assert len(text[key]) == text["num_hidden_layers"], (entry.hf_id, key)
        if "hybrid_override_pattern" in text:
            assert len(text["hybrid_override_pattern"]) == text["num_hidden_layers"], entry.hf_id


def test_ids_and_aliases_are_unique_across_entries() -> None:
    owner: dict[str, str] = {}
    for entry in catalog():
        for name in {n.lower() for n in entry.names()}:
            assert name not in owner, f"{name!r} names both {owner[name]} and {entry.hf_id}"
            owner[name] = entry.hf_id


def test_find_by_id_short_name_and_alias_ignoring_case() -> None:
    by_id = _entry("openai/gpt-oss-20b")
    assert _entry("GPT-OSS-20B").hf_id == by_id.hf_id
    assert _entry("  gpt-oss-20b ").hf_id == by_id.hf_id
    assert _entry("gemma-3-27b").hf_id == "google/gemma-3-27b-it"
    assert _entry("gemma-3-27b-it").hf_id == "google/gemma-3-27b-it"
    assert _entry("qwen3-next-80b").hf_id == "Qwen/Qwen3-Next-80B-A3B-Instruct"
    assert _entry("jamba-mini").config["model_type"] == "jamba"
    assert find("no-such-model") is None


def test_returned_configs_are_copies() -> None:
    entry = _entry("gpt-oss-20b")
    entry.config["num_hidden_layers"] = 1
    assert _entry("gpt-oss-20b").config["num_hidden_layers"] == 24


def test_gpt_oss_20b_alternates_sliding_128_and_full() -> None:
    config = _entry("gpt-oss-20b").config
    assert config["model_type"] == "gpt_oss"
    assert config["num_hidden_layers"] == 24
    assert config["sliding_window"] == 128
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 12


def test_gpt_oss_120b_has_36_layers_half_full() -> None:
    config = _entry("gpt-oss-120b").config
    assert config["num_hidden_layers"] == 36
    assert config["layer_types"].count("full_attention") == 18


def test_gemma_3_27b_is_62_layers_5_to_1_with_window_1024() -> None:
    entry = _entry("gemma-3-27b")
    assert entry.config["model_type"] == "gemma3"
    text = entry.config["text_config"]
    assert text["model_type"] == "gemma3_text"
    assert text["num_hidden_layers"] == 62
    assert text["sliding_window"] == 1024
    assert text["sliding_window_pattern"] == 6
    full = [i for i in range(62) if (i + 1) % text["sliding_window_pattern"] == 0]
    assert len(full) == 10 and 62 - len(full) == 52


def test_qwen3_next_has_full_attention_every_fourth_layer() -> None:
    config = _entry("qwen3-next").config
    assert config["model_type"] == "qwen3_next"
    assert config["num_hidden_layers"] == 48
    assert config["full_attention_interval"] == 4
    assert (config["linear_num_key_heads"], config["linear_num_value_heads"]) == (16, 32)


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3.6-35b-a3b"])
def test_qwen3_5_family_is_3_linear_to_1_full_with_fp32_state(name: str) -> None:
    text = _text(_entry(name))
    layers = text["num_hidden_layers"]
    assert layers % 4 == 0
    assert text["full_attention_interval"] == 4
    block = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert text["layer_types"] == block * (layers // 4)
    assert text["mamba_ssm_dtype"] == "float32"


def test_gemma_3n_shares_kv_of_its_last_15_layers() -> None:
    text = _text(_entry("gemma-3n-e4b"))
    assert text["num_hidden_layers"] == 35
    assert text["num_kv_shared_layers"] == 15
    assert text["layer_types"].count("full_attention") == 7


def test_llama_4_scout_is_chunked_with_nope_every_fourth_layer() -> None:
    text = _text(_entry("llama-4-scout"))
    assert text["attention_chunk_size"] == 8192
    assert text["no_rope_layers"] == [1, 1, 1, 0] * 12


def test_mamba_hybrids_place_attention_where_published() -> None:
    jamba = _entry("jamba-v0.1").config
    attention = [i for i in range(32) if i % jamba["attn_layer_period"] == jamba["attn_layer_offset"]]
    assert attention == [4, 12, 20, 28]
    granite = _entry("granite-4.0-h-tiny").config
    assert [i for i, t in enumerate(granite["layer_types"]) if t == "attention"] == [5, 15, 25, 35]
    nemotron = _entry("nemotron-nano-9b-v2").config
    assert nemotron["hybrid_override_pattern"].count("*") == 4
    assert nemotron["hybrid_override_pattern"].count("M") == 27


def test_lfm2_has_six_attention_layers_and_ten_short_conv_states() -> None:
    from hybridkv.plan.model_specs import model_spec_from_config
    from hybridkv.plan.specs import MambaSpec

    spec = model_spec_from_config(_entry("lfm2-1.2b").config, name="lfm2")
    states = [i for i, layer in enumerate(spec.layers) if isinstance(layer, MambaSpec)]
    assert states == [0, 1, 3, 4, 6, 7, 9, 11, 13, 15]
    assert {layer.shapes for layer in spec.layers if isinstance(layer, MambaSpec)} == {((2, 2048),)}
