"""The index's block keys: the Mooncake Conductor's rolling sequence hashes (RFC #1527).

    local[i] = XXH3-64(tokens of block i as little-endian u32, seed S)
    seq[0]   = local[0]
    seq[i]   = XXH3-64(seq[i-1] as 8 little-endian bytes || local[i] as 8 little-endian bytes, seed S)

`seq[i]` names the whole prefix up to block i, so it is computed from token ids alone, the same for
every engine and every group of one block size: the index keys blocks by it and maps each engine's
own block hashes onto it. A router that hashes prompts itself sends these to `/query_by_hash`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

#: the standard's seed (Dynamo's KV router uses the same value)
SEED = 1337

_pack = struct.Struct("<QQ").pack
_xxh = xxhash.xxh3_64_intdigest


def token_bytes(token_ids: Sequence[int]) -> memoryview:
    """Token ids as little-endian u32 bytes (ValueError naming the first id outside u32)."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        bad = arr[(arr < 0) | (arr > 0xFFFFFFFF)][0]
        raise ValueError(f"token id {int(bad)} is outside 0..4294967295")
    return memoryview(arr.astype("<u4").tobytes())


def iter_seq_hashes(data: memoryview, block_size: int, parent: int | None = None,
                    seed: int = SEED) -> Iterator[int]:
    """The sequence hash of each full block of `data` (u32 tokens), chained onto `parent`."""
    stride = 4 * block_size
    prev = parent
    for offset in range(0, len(data) - stride + 1, stride):
        local = _xxh(data[offset : offset + stride], seed)
        prev = local if prev is None else _xxh(_pack(prev, local), seed)
        yield prev


def seq_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None,
               seed: int = SEED) -> list[int]:
    """All full blocks' sequence hashes of `token_ids` (the trailing partial block has none)."""
    return list(iter_seq_hashes(token_bytes(token_ids), block_size, parent, seed))
