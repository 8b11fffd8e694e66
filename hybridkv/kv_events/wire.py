"""vLLM 0.32's KV event wire format, byte for byte, and its `--kv-events-config` JSON.

A publisher sends ZMQ multipart messages on a PUB socket:

    [topic bytes, sequence number (8 bytes, big endian, from 0), msgpack(KVEventBatch)]

and answers replay requests on a ROUTER socket: a client sends `[b"", start seq (8 bytes)]`
(a DEALER adds the empty delimiter itself) and gets `[b"", seq, payload]` for every buffered batch
from `start` on, then `[b"", -1 (8 bytes, signed), b""]`.

A batch is a msgpack array `[ts, [events...], data_parallel_rank]` (vLLM's `EventBatch` is
`array_like`; the rank is left out when None); each event is a map tagged by `"type"`:
`BlockStored`, `BlockRemoved` or `AllBlocksCleared`. Block hashes are
the engine's (ints by default in vLLM: the last 8 bytes of the digest; bytes otherwise): the index
never interprets them, it keys blocks by the tokens in `BlockStored.token_ids` (seq_hash.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from hybridkv.errors import ConfigError

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEventsConfig",
    "WireError",
    "decode_batch",
    "encode_batch",
]

#: the replay stream's end marker (vLLM: `(-1).to_bytes(8, "big", signed=True)`)
END_SEQ = (-1).to_bytes(8, "big", signed=True)

ExternalHash = int | bytes


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """Consecutive full blocks of one group were cached (vLLM's `BlockStored`, same fields and order)."""

    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # one entry per block: a list of extra keys, or None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    """Cached blocks of one group were evicted."""

    block_hashes: list[ExternalHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    """The publisher's whole prefix cache was reset."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: the events of one engine step."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


class WireError(ValueError):
    """A message that is not a vLLM KV event batch."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in `payload`; `WireError` (one line) when it is not one."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise WireError(f"not a KV event batch ({len(payload)} bytes): {e}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (the fields hybridkv reads; others are accepted and ignored)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ConfigError(f"kv events publisher {self.publisher!r} is not supported; expected 'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv events {name} must be positive, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse vLLM's JSON (`'{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config is not JSON ({e.msg} at character {e.pos}): {text[:80]!r}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--kv-events-config must be a JSON object, got {type(raw).__name__}")
        fields = {f: raw[f] for f in cls.__dataclass_fields__ if f in raw}
        types = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "buffer_steps": int,
                 "hwm": int, "max_queue_size": int, "topic": str}
        for name, value in fields.items():
            expected = types.get(name)
            if name == "replay_endpoint" and value is not None and not isinstance(value, str):
                expected = str
            if expected is not None and (not isinstance(value, expected) or
                                         (expected is int and isinstance(value, bool))):
                raise ConfigError(f"--kv-events-config field {name!r} must be {expected.__name__}, got {value!r}")
        return cls(**fields)
