"""`CacheOptions` and its presets: the values the project documents, written out by hand here, and one-line
errors that name the field."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.errors import ConfigError
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import (
    DEFAULT_PRESET,
    PRESETS,
    CacheOptions,
    describe,
    options_from,
    preset,
)
from hybridkv.simulate.simulator import SimOptions
from tests.factories import make_config, make_group

#: the presets as docs/prefix_caching.md states them (field -> value), against CacheOptions()
VLLM = {"release_order": "by_group"}
HYBRIDKV = {"eviction": "value", "checkpoint_placement": "placed", "state_layout": "multi_page",
            "running_state": "adopt", "decode_checkpoints": "last", "admission_headroom": "waiting_hits",
            "queue_order": "cache_aware", "turn_checkpoints": True, "online_choice": "ghosts"}


def _differences(options: CacheOptions) -> dict[str, object]:
    base = CacheOptions()
    return {f.name: getattr(getattr(options, f.name), "value", getattr(options, f.name))
            for f in dataclasses.fields(options) if getattr(options, f.name) != getattr(base, f.name)}


def test_the_presets_are_what_the_docs_say() -> None:
    assert _differences(PRESETS["vllm"]) == VLLM
    assert _differences(PRESETS["hybridkv"]) == HYBRIDKV
    assert DEFAULT_PRESET == "vllm"
    assert describe(PRESETS["hybridkv"]) == "hybridkv"
    assert describe(PRESETS["vllm"].replace(eviction="value")) == "vllm + eviction=value"


def test_options_from_takes_strings_and_keeps_the_rest_of_the_preset() -> None:
    options = options_from("hybridkv", {"eviction": "lru", "checkpoint_interval_tokens": 64})
    assert _differences(options) == {**{k: v for k, v in HYBRIDKV.items() if k != "eviction"},
                                     "checkpoint_interval_tokens": 64}


@pytest.mark.parametrize(("preset_name", "changes", "message"), [
    ("fast", {}, "unknown cache preset 'fast'; expected one of vllm, hybridkv"),
    ("vllm", {"evict": "lru"}, "unknown cache option 'evict'; expected one of prefix_caching,"),
    ("vllm", {"eviction": "fifo"}, "eviction must be one of ['lru', 'value'], got 'fifo'"),
    ("vllm", {"prefix_cache_retention_interval": -1}, "prefix_cache_retention_interval must be None or an integer"),
    ("vllm", {"prefix_match_unit": 0}, "prefix_match_unit must be None or a positive integer (tokens), got 0"),
    ("vllm", {"turn_checkpoints": "yes"}, "turn_checkpoints must be true or false, got 'yes'"),
    ("vllm", {"hash_seed": 2**64}, "hash_seed must be an integer in [0, 2**64)"),
    ("vllm", {"running_state": "fixed", "mamba_cache_mode": "all"}, "running_state=fixed copies a checkpoint"),
])
def test_bad_options_are_one_line_errors_naming_the_field(preset_name: str, changes: dict[str, object],
                                                          message: str) -> None:
    with pytest.raises(ConfigError) as error:
        options_from(preset_name, changes)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_validate_refuses_what_these_groups_cannot_take() -> None:
    config = make_config(groups=[make_group(kind="full", block_size=16), make_group(kind="mamba", block_size=64)],
                         num_blocks=32)
    with pytest.raises(ConfigError, match="spec_decode=eagle is modelled for full and sliding-window groups"):
        KVCacheManager(config, max_model_len=256, options=options_from("vllm", {"spec_decode": "eagle"}))
    with pytest.raises(ConfigError, match="running_state=fixed with prefix_match_unit=16"):
        KVCacheManager(config, max_model_len=256, options=options_from("vllm", {"running_state": "fixed",
                                                                                "prefix_match_unit": 16}))
    unit = CacheOptions(prefix_match_unit=16).validate(config)
    assert (unit.hash_unit_tokens, unit.partial_hits) == (16, True)


def test_engine_and_simulator_hold_one_options_object() -> None:
    config = EngineConfig.from_options({"preset": "hybridkv", "eviction": "lru", "max_num_seqs": 4})
    assert config.max_num_seqs == 4 and config.cache == PRESETS["hybridkv"].replace(eviction="lru")
    assert EngineConfig.from_options({}).cache == preset("vllm")
    with pytest.raises(ConfigError, match="unknown engine option"):
        EngineConfig.from_options({"evictions": "lru"})
    assert SimOptions(max_model_len=64).cache == CacheOptions()


def test_the_policies_view_reports_what_is_on() -> None:
    config = make_config(groups=[make_group(kind="full", block_size=4)], num_blocks=16)
    plain = KVCacheManager(config, max_model_len=64)
    assert plain.policies.marks is None and plain.policies.anchors is None and plain.policies.reserve is None
    assert plain.policies.stats().eviction == "lru" and plain.policies.value_of(1) is None
    both = options_from("vllm", {"eviction": "value", "admission_headroom": "next_block"})
    valued = KVCacheManager(config, max_model_len=64, options=both)
    assert valued.policies.marks is not None and valued.policies.anchors is not None
    assert valued.policies.reserve is not None and valued.policies.reserve.blocks((), running=3) == 3
    assert valued.policies.stats().eviction == "value"
