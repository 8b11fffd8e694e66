"""Object keys: which bytes one object of one chunk of one object group is stored under.

    key = b"hkv" | format version (1 byte) | namespace (16 bytes) | chunk index (4 bytes, BE) | chunk hash

    namespace = xxh3-128 over (model identity, rank, world size, layout fingerprint,
                               object group name, cache salt), each length-prefixed

So a lookup with another salt, another layout, another rank or another key format never hits,
and an L2 tier written by an older format is simply not read (never misread).
"""

from __future__ import annotations

import struct

import xxhash

from hybridkv.wire import FORMAT_VERSION, Layout

KEY_PREFIX = b"hkv" + bytes([FORMAT_VERSION])


def namespace(layout: Layout, object_group: str, cache_salt: str) -> bytes:
    h = xxhash.xxh3_128()
    for part in (layout.model, str(layout.rank), str(layout.world_size), layout.fingerprint, object_group,
                 cache_salt):
        data = part.encode()
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.digest()


def object_key(ns: bytes, chunk: int, chunk_hash: bytes) -> bytes:
    return KEY_PREFIX + ns + struct.pack(">I", chunk) + chunk_hash
