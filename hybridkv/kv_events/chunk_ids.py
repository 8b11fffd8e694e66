"""The ids under which `hybridkv server` publishes its chunks, and how an index computes them from a
prompt's token ids.

    chunk hash  h_i = XXH3-128(h_{i-1} || chunk i's tokens as little-endian int64), h_-1 = 16 zero bytes
                (the connector's chain, connector/client.py `chunk_hashes`: the server's key holds it)
    chunk id    h_i without a cache salt; with one, XXH3-128(b"salt" || len(salt) u32 LE || salt || h_i)

The server knows no token ids, only the chain its clients send; the chain depends on the token ids
alone (no seed, no model), so an index that has a prompt's token ids computes the same ids. The salt
is folded in so that the stream shows no salt and no unsalted hash of a salted prompt: an index
finds a tenant's chunks only when the query brings that tenant's salt.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "SERVER_TYPE", "chunk_hash_chain", "chunk_id", "chunk_key"]

#: the `type` a KV cache server's stream is registered under at an index, and the media of its tiers
SERVER_TYPE = "hybridkv-server"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


def chunk_hash_chain(tokens_u32: memoryview | bytes, chunk_tokens: int) -> list[bytes]:
    """The chained chunk hash of every full chunk of the tokens (little-endian u32 bytes)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    tokens = np.frombuffer(tokens_u32, dtype="<u4").astype("<i8")
    parent = bytes(16)
    out = []
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        parent = xxhash.xxh3_128_digest(parent + tokens[start:start + chunk_tokens].tobytes())
        out.append(parent)
    return out


def chunk_id(chunk_hash: bytes, salt: str | None) -> bytes:
    """The published id of a chunk stored under `salt` ("" or None: no salt)."""
    if not salt:
        return chunk_hash
    data = salt.encode()
    return xxhash.xxh3_128_digest(b"salt" + struct.pack("<I", len(data)) + data + chunk_hash)


def chunk_key(chunk_id_: bytes) -> int:
    """An index's 64-bit key for a chunk id (its first 8 bytes)."""
    return int.from_bytes(chunk_id_[:8], "little")
