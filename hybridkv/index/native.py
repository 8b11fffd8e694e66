"""The index's two native loops (`seq_chain.c`, `json_u32.c`), built on first use with the system's C
compiler: the sequence-hash loop and the parse of a JSON array of token ids.

A 32k-token prompt is 2048 blocks of 16 tokens: two XXH3 calls per block, ~4,000 calls that cost
~0.25 us each from Python (the call, the 16-byte pack, the list append) and ~20 ns each from C.
The C loop calls the XXH3 of the `xxhash` package the index already loads (its exported
`XXH3_64bits_withSeed`), so both paths hash with the same library and give the same numbers.

A `/query` body's 32k token ids are ~200 KB of JSON: msgspec decodes them into a list of Python
ints in ~0.8 ms (32k int objects), which the hash loop then packs back into u32s; the C parse
writes the u32s directly: ~0.15 ms number after number (seq_chain.c, any JSON spacing), ~0.11 ms
for the spellings JSON encoders write (json_u32.c: the number starts found 64 bytes at a time with
AVX2, then the numbers read four at a time; measured in C on the project's 2-core VM beside other
work).

The shared object is built on first use (`native_build.py`: `$CC`, cached by a hash). `HYBRIDKV_KERNELS=0`,
no compiler, a big-endian host, or an `xxhash` build that does not export the function: the
Python loop (seq_hash.py), silently (the results are the same, only slower).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash._xxhash

from hybridkv.native_build import kernels_enabled, shared_object

__all__ = ["native_seq_hashes", "native_split_array", "native_u32_array"]

_SOURCES = [Path(__file__).with_name(name) for name in ("seq_chain.c", "json_u32.c")]
_HEADER = Path(__file__).with_name("swar_digits.h")
_FLAGS = ("-O2", "-shared", "-fPIC", "-Wl,-z,defs")
_SLACK = 32  # (json_u32.c writes the offsets of 16 numbers at a time: room past the count)
_XXH3 = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64)


@functools.cache
def _loaded() -> tuple[ctypes.CDLL, int] | None:
    """The kernel and the address of XXH3_64bits_withSeed, or None (the Python loop then)."""
    if not kernels_enabled() or sys.byteorder != "little":
        return None
    try:
        lib = ctypes.CDLL(str(shared_object("hybridkv_index", _SOURCES, flags=_FLAGS, key_files=[_HEADER])))
        xxh3 = ctypes.cast(ctypes.CDLL(xxhash._xxhash.__file__).XXH3_64bits_withSeed, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    if not xxh3:
        return None
    fn = lib.hkv_seq_hashes
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p]
    parse = lib.hkv_parse_u32_range
    parse.restype = ctypes.c_int64
    parse.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    take = lib.hkv_take_u32_array
    take.restype = ctypes.c_int64
    take.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    return lib, xxh3


def native_seq_hashes(data: memoryview, block_size: int, parent: int | None, seed: int) -> Sequence[int] | None:
    """The sequence hashes of the full blocks of `data` (little-endian u32 tokens), or None when the
    kernel is unavailable: a memoryview of u64s (indexing it gives ints; a query reads a few dozen of
    2048, so no list of them is made)."""
    loaded = _loaded()
    if loaded is None:
        return None
    lib, xxh3 = loaded
    num_blocks = len(data) // (4 * block_size)
    if num_blocks == 0:
        return ()
    tokens = np.frombuffer(data, dtype=np.uint32, count=num_blocks * block_size)
    out = np.empty(num_blocks, dtype=np.uint64)
    lib.hkv_seq_hashes(xxh3, tokens.ctypes.data, num_blocks, block_size, parent is not None, parent or 0, seed,
                       out.ctypes.data)
    return out.data


def native_u32_array(raw: bytes, start: int = 0, end: int | None = None) -> memoryview | None:
    """The JSON array of u32 token ids in raw[start:end] as little-endian u32 bytes; None when the
    kernel is unavailable or the text is anything else (a negative or fractional number, a value over
    u32, not an array: the caller's slow path then says what is wrong)."""
    loaded = _loaded()
    if loaded is None:
        return None
    end = len(raw) if end is None else end
    out = np.empty((end - start) // 2 + _SLACK, dtype=np.uint32)  # (each id takes a digit and a comma at least)
    count = loaded[0].hkv_parse_u32_range(raw, start, end, out.ctypes.data, out.size)
    if count < 0:
        return None
    return out[:count].data.cast("B")


def native_split_array(raw: bytes, key: bytes) -> tuple[bytes, memoryview] | None:
    """A JSON object's top-level `key`, an array of u32s, parsed natively and cut out: (the object
    with `[]` in its place, the u32s as little-endian bytes). None when the kernel is unavailable,
    the key is absent, or anything is unusual (the caller decodes the whole text instead): one pass
    over the numbers instead of a decoder's scan and then a parse."""
    loaded = _loaded()
    if loaded is None:
        return None
    count, start, end = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    out = np.empty(len(raw) // 2 + _SLACK, dtype=np.uint32)
    if loaded[0].hkv_take_u32_array(raw, len(raw), key, len(key), out.ctypes.data, out.size, ctypes.byref(count),
                                    ctypes.byref(start), ctypes.byref(end)) != 1:
        return None
    return raw[: start.value] + b"[]" + raw[end.value :], out[: count.value].data.cast("B")
