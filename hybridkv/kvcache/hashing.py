"""Chained block hashes: the prefix-cache keys of full blocks.

    hash(block i) = H( parent | tokens | extra )
        parent = hash(block i-1), or the root H(ROOT_TAG | seed) for block 0   (16 or 32 bytes)
        tokens = the block's token ids as little-endian int64                  (8 * block_size bytes)
        extra  = tagged, length-prefixed extra keys, empty for a plain block   (variable, last)

Only full blocks are hashed. Because `parent` and `tokens` have a fixed length for a given
algorithm and block size, appending the variable `extra` at the end keeps the encoding
unambiguous. Extra keys:

- cache salt (block 0 only: the chain carries it to every later block; isolates tenants),
- LoRA adapter name (every block),
- multimodal items: the identifier and start offset of every item overlapping the block.

The encoding is a plain byte layout (no pickle, no `hash()`), so hashes are identical across
processes and machines for the same seed. `HashAlgo.XXH3_128` is the fast default;
`HashAlgo.SHA256` is available when collision resistance against adversarial prompts matters.

Groups with different block sizes: hashes are computed once per *distinct* block size and kept
in `KVRequest.block_hashes[block_size]`. Composing larger-block hashes from smaller ones would
save nothing measurable (models have one or two distinct block sizes) and would tie the key of a
large block to the small block size.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from enum import Enum

import xxhash

from hybridkv.kvcache.ids import BlockHash
from hybridkv.kvcache.request import KVRequest

ROOT_TAG = b"hybridkv.block_hash.v1"
_TAG_SALT = 1
_TAG_LORA = 2
_TAG_MM = 3
_BIG_ENDIAN = sys.byteorder == "big"


class HashAlgo(Enum):
    """Digest used for block hashes."""

    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[HashAlgo, Callable[[bytes], bytes]] = {
    HashAlgo.XXH3_128: xxhash.xxh3_128_digest,
    HashAlgo.SHA256: _sha256,
}


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (the `tokens` part of the encoding)."""
    packed = array("q", token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _field(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BI", tag, len(payload)) + payload


def encode_extra(request: KVRequest, block_index: int, block_size: int) -> bytes:
    """The `extra` bytes of block `block_index` of `request` (empty for a plain block)."""
    parts: list[bytes] = []
    if request.cache_salt is not None and block_index == 0:
        parts.append(_field(_TAG_SALT, request.cache_salt.encode()))
    if request.lora_name is not None:
        parts.append(_field(_TAG_LORA, request.lora_name.encode()))
    start = block_index * block_size
    end = start + block_size
    for item in request.mm_features:
        if item.offset_tokens < end and item.offset_tokens + item.length_tokens > start:
            parts.append(_field(_TAG_MM, item.identifier.encode() + struct.pack("<q", item.offset_tokens)))
    return b"".join(parts)


class BlockHasher:
    """Computes and extends the block hash chains of requests.

    One hasher per manager; `algo` and `seed` must be the same in every process that shares
    cached blocks (e.g. through the KV cache server), since they determine every hash.
    """

    def __init__(self, *, algo: HashAlgo = HashAlgo.XXH3_128, seed: int = 0) -> None:
        self.algo = algo
        self.seed = seed
        self._digest = _DIGESTS[algo]
        self.root: BlockHash = self._digest(ROOT_TAG + seed.to_bytes(16, "little", signed=True))

    def update(self, request: KVRequest, block_size: int) -> list[BlockHash]:
        """Extend `request.block_hashes[block_size]` to cover every full block; return that list.

        Only blocks that became full since the last call are hashed; the tokens of all of them
        are packed with one `array` call and hashed block by block over slices of that buffer.
        """
        hashes = request.block_hashes.get(block_size)
        if hashes is None:
            hashes = request.block_hashes[block_size] = []
        start = len(hashes)
        end = len(request.token_ids) // block_size
        if end <= start:
            return hashes
        data = pack_tokens(request.token_ids[start * block_size : end * block_size])
        stride = 8 * block_size
        parent = hashes[-1] if start else self.root
        digest = self._digest
        append = hashes.append
        if request.cache_salt is None and request.lora_name is None and not request.mm_features:
            for offset in range(0, len(data), stride):
                parent = digest(parent + data[offset : offset + stride])
                append(parent)
            return hashes
        for index in range(start, end):
            offset = (index - start) * stride
            parent = digest(parent + data[offset : offset + stride] + encode_extra(request, index, block_size))
            append(parent)
        return hashes
