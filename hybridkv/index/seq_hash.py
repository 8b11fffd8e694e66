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
import sys
from array import array
from collections.abc import Iterator, Sequence
from itertools import chain, repeat

import xxhash

from hybridkv.index.native import native_seq_hashes

#: the standard's seed (Dynamo's KV router uses the same value)
SEED = 1337

_pack = struct.Struct("<QQ").pack
_xxh = xxhash.xxh3_64_intdigest
_SWAP = sys.byteorder == "big"
assert array("I").itemsize == 4, "the index needs 4-byte unsigned ints"


def token_bytes(token_ids: Sequence[int]) -> memoryview:
    """Token ids as little-endian u32 bytes (ValueError naming the first id outside u32)."""
    try:
        arr = array("I", token_ids)  # (a C loop: 3x numpy's conversion of a list)
    except (OverflowError, TypeError):
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t <= 0xFFFFFFFF), None)
        raise ValueError(f"token id {bad!r} is outside 0..4294967295") from None
    if _SWAP:
        arr.byteswap()
    return memoryview(arr).cast("B")


def seq_hash_chunks(data: memoryview, block_size: int, parent: int | None = None,
                    seed: int = SEED, chunk_blocks: int = 64) -> Iterator[Sequence[int]]:
    """The sequence hashes of the full blocks of `data` (u32 tokens), chained onto `parent`: all in
    one list from the native loop (native.py), else in lists of `chunk_blocks` (local hashes in one
    C-level map per list), so a caller that stops early saves the rest."""
    hashes = native_seq_hashes(data, block_size, parent, seed)
    if hashes is not None:
        yield hashes
        return
    stride = 4 * block_size
    prev = parent
    end = len(data) - stride + 1
    for first in range(0, max(end, 0), stride * chunk_blocks):
        stop = min(first + stride * chunk_blocks, end)
        locals_ = list(map(_xxh, [data[o : o + stride] for o in range(first, stop, stride)], repeat(seed)))
        out: list[int] = []
        append = out.append
        for local in locals_:
            prev = local if prev is None else _xxh(_pack(prev, local), seed)
            append(prev)
        yield out


def iter_seq_hashes(data: memoryview, block_size: int, parent: int | None = None,
                    seed: int = SEED) -> Iterator[int]:
    """The sequence hash of each full block of `data`, one by one."""
    return chain.from_iterable(seq_hash_chunks(data, block_size, parent, seed))


def seq_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None,
               seed: int = SEED) -> list[int]:
    """All full blocks' sequence hashes of `token_ids` (the trailing partial block has none)."""
    return list(iter_seq_hashes(token_bytes(token_ids), block_size, parent, seed))
