"""The KV event wire format is vLLM 0.32's byte for byte, and `--kv-events-config` is vLLM's JSON."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.errors import ConfigError
from hybridkv.index.seq_hash import SEED, seq_hashes
from hybridkv.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    WireError,
    decode_batch,
    encode_batch,
)


def test_a_batch_encodes_as_vllms_tagged_maps() -> None:
    """vLLM's structs: the batch an array [ts, events, rank] (vLLM 0.32's EventBatch is array_like),
    each event a map, tag field "type" = the class name, defaults omitted, the required-but-None
    fields (lora_id, medium, lora_name) kept. (tests/vllm decodes vLLM's own encoder's bytes.)"""
    batch = EventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                    medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=8),
        BlockRemoved(block_hashes=[7], medium="GPU", group_idx=1),
        AllBlocksCleared(),
    ], data_parallel_rank=0)
    expected = [1.5, [
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
         "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
         "kv_cache_spec_sliding_window": 8},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 1},
        {"type": "AllBlocksCleared"},
    ], 0]
    assert encode_batch(batch) == msgspec.msgpack.encode(expected)
    assert decode_batch(encode_batch(batch)) == batch


def test_older_and_newer_publishers_decode() -> None:
    """No group fields (older vLLM) and unknown fields (newer vLLM) both decode."""
    raw = msgspec.msgpack.encode([0.0, [
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None, "token_ids": [1],
         "block_size": 1, "lora_id": None, "medium": None, "lora_name": None, "snapshot_version": 3}], None, "later"])
    (event,) = decode_batch(raw).events
    assert isinstance(event, BlockStored) and event.group_idx is None and event.block_hashes == [b"\x01" * 32]


@pytest.mark.parametrize("payload", [b"", b"\x93\x01\x02\x03", msgspec.msgpack.encode(["x", []]),
                                     msgspec.msgpack.encode({"ts": 0.0, "events": []})])
def test_garbage_is_a_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError, match="not a KV event batch"):
        decode_batch(payload)


def test_seq_hashes_follow_the_conductor_standard() -> None:
    """seq[0] = XXH3(u32 LE tokens, S); seq[i] = XXH3(seq[i-1] LE || local[i] LE, S), recomputed here."""
    import struct

    import xxhash

    tokens = list(range(10))
    local = [xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens[i:i + 4]), SEED) for i in (0, 4)]
    expected = [local[0], xxhash.xxh3_64_intdigest(struct.pack("<QQ", local[0], local[1]), SEED)]
    assert seq_hashes(tokens, 4) == expected
    with pytest.raises(ValueError, match="outside"):
        seq_hashes([-1, 0, 0, 0], 4)


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_native_and_python_chains_match_a_recomputation(kernels: str, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """The C loop (native.py) and the Python loop both give the standard's chain, from the root and
    from a parent, for block sizes whose byte lengths cross XXH3's length classes (4 .. 2304 bytes)."""
    import random
    import struct

    import xxhash

    from hybridkv.index import native
    from hybridkv.index.seq_hash import iter_seq_hashes, token_bytes

    monkeypatch.setenv("HYBRIDKV_KERNELS", kernels)
    monkeypatch.setenv("HYBRIDKV_KERNEL_CACHE", str(tmp_path))
    native._loaded.cache_clear()
    try:
        if kernels == "1":
            assert native.native_seq_hashes(token_bytes([1] * 8), 4, None, SEED) is not None, "kernel not built"
        rng = random.Random(5)
        for block_size in (1, 3, 16, 61, 576):
            tokens = [rng.randrange(1 << 32) for _ in range(block_size * 5 + min(2, block_size - 1))]
            for parent in (None, rng.randrange(1 << 64)):
                prev, expected = parent, []
                for i in range(5):
                    block = tokens[i * block_size : (i + 1) * block_size]
                    local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), SEED)
                    prev = local if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), SEED)
                    expected.append(prev)
                assert list(iter_seq_hashes(token_bytes(tokens), block_size, parent)) == expected
    finally:
        native._loaded.cache_clear()


def test_kv_events_config_is_vllms_json() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                      '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}')
    assert config.enabled and config.replay_endpoint == "tcp://*:5558" and config.buffer_steps == 10_000
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false, "publisher": "zmq"}').enabled


@pytest.mark.parametrize(("text", "needle"), [
    ("{", "not JSON"), ("[]", "JSON object"), ('{"publisher": "kafka"}', "'kafka' is not supported"),
    ('{"buffer_steps": 0}', "buffer_steps must be positive"), ('{"hwm": "many"}', "'hwm' must be int"),
])
def test_bad_kv_events_config_is_one_line(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(kv_events_config=text)


def test_the_index_and_the_router_import_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, hybridkv.index.http, hybridkv.index.publisher, hybridkv.route.app, hybridkv.route.local, "
            "hybridkv.cli.index, hybridkv.cli.route; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
