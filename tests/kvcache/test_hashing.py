"""Block hash vectors: the byte encoding re-derived by hand, chaining, extra keys, determinism."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import xxhash

from hybridkv.kvcache.hashing import ROOT_TAG, BlockHasher, HashAlgo
from hybridkv.kvcache.request import MultiModalFeature
from tests.factories import make_request


def _root(seed: int) -> bytes:
    return xxhash.xxh3_128_digest(ROOT_TAG + seed.to_bytes(16, "little", signed=True))


def _tokens(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}q", *ids)


def _field(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BI", tag, len(payload)) + payload


def test_plain_chain_matches_the_documented_encoding() -> None:
    request = make_request(token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    hashes = BlockHasher(seed=7).update(request, 4)
    h0 = xxhash.xxh3_128_digest(_root(7) + _tokens([1, 2, 3, 4]))
    h1 = xxhash.xxh3_128_digest(h0 + _tokens([5, 6, 7, 8]))
    assert hashes == [h0, h1]  # token 9 is a partial block: not hashed
    assert len(h0) == 16


def test_chaining_makes_a_block_depend_on_its_whole_prefix() -> None:
    hasher = BlockHasher()
    a = hasher.update(make_request(token_ids=[1, 2, 3, 4, 5, 6]), 3)
    b = hasher.update(make_request(token_ids=[9, 2, 3, 4, 5, 6]), 3)
    c = hasher.update(make_request(token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9]), 3)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert c[:2] == a


def test_salt_enters_block_zero_only_and_propagates_through_the_chain() -> None:
    salted = BlockHasher().update(make_request(token_ids=[1, 2, 3, 4], cache_salt="tenant-a"), 2)
    h0 = xxhash.xxh3_128_digest(_root(0) + _tokens([1, 2]) + _field(1, b"tenant-a"))
    h1 = xxhash.xxh3_128_digest(h0 + _tokens([3, 4]))
    assert salted == [h0, h1]
    other = BlockHasher().update(make_request(token_ids=[1, 2, 3, 4], cache_salt="tenant-b"), 2)
    assert other[0] != salted[0] and other[1] != salted[1]


def test_lora_enters_every_block_and_mm_items_only_overlapping_blocks() -> None:
    item = MultiModalFeature(identifier="img-1", offset_tokens=3, length_tokens=2)  # tokens 3..4
    request = make_request(token_ids=list(range(8)), lora_name="fr", mm_features=[item])
    hashes = BlockHasher().update(request, 2)
    lora = _field(2, b"fr")
    mm = _field(3, b"img-1" + struct.pack("<q", 3))
    h0 = xxhash.xxh3_128_digest(_root(0) + _tokens([0, 1]) + lora)
    h1 = xxhash.xxh3_128_digest(h0 + _tokens([2, 3]) + lora + mm)
    h2 = xxhash.xxh3_128_digest(h1 + _tokens([4, 5]) + lora + mm)
    h3 = xxhash.xxh3_128_digest(h2 + _tokens([6, 7]) + lora)
    assert hashes == [h0, h1, h2, h3]


def test_incremental_update_hashes_only_new_full_blocks() -> None:
    hasher = BlockHasher()
    request = make_request(token_ids=[5, 6, 7])
    assert hasher.update(request, 2) == request.block_hashes[2]
    first = list(request.block_hashes[2])
    assert len(first) == 1
    request.token_ids += [8, 9, 10]
    grown = hasher.update(request, 2)
    assert grown[:1] == first and len(grown) == 3
    assert grown == hasher.update(make_request(token_ids=[5, 6, 7, 8, 9, 10]), 2)
    assert 4 not in request.block_hashes
    assert len(hasher.update(request, 4)) == 1  # each block size has its own chain


def test_seed_and_algorithm_change_every_hash() -> None:
    tokens = list(range(8))
    base = BlockHasher(seed=0).update(make_request(token_ids=tokens), 4)
    assert BlockHasher(seed=1).update(make_request(token_ids=tokens), 4)[0] != base[0]
    sha = BlockHasher(algo=HashAlgo.SHA256).update(make_request(token_ids=tokens), 4)
    root = hashlib.sha256(ROOT_TAG + (0).to_bytes(16, "little", signed=True)).digest()
    assert sha[0] == hashlib.sha256(root + _tokens([0, 1, 2, 3])).digest()
    assert len(sha[0]) == 32


_CHILD = """
import json, sys
from hybridkv.kvcache.hashing import BlockHasher, HashAlgo
from hybridkv.kvcache.request import KVRequest
out = {}
for algo in HashAlgo:
    request = KVRequest(request_id="x", token_ids=list(range(100, 140)), cache_salt="s", lora_name="l")
    out[algo.value] = [h.hex() for h in BlockHasher(algo=algo, seed=42).update(request, 16)]
print(json.dumps(out))
"""


def test_hashes_are_identical_in_another_process() -> None:
    result = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    child = json.loads(result.stdout)
    for algo in HashAlgo:
        request = make_request(request_id="x", token_ids=list(range(100, 140)), cache_salt="s", lora_name="l")
        mine = [h.hex() for h in BlockHasher(algo=algo, seed=42).update(request, 16)]
        assert child[algo.value] == mine
        assert len(mine) == 2
