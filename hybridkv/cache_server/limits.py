"""What one client can make the server hold, or do in one request: every bound and its default
(docs/cache_server_security.md lists them), and the checks that refuse a request over one before
anything changes (BAD_REQUEST for a request no server would take, LIMIT for a full budget).

    per request     chunk hashes <= MAX_CHUNKS_PER_REQUEST, each <= MAX_CHUNK_HASH_BYTES;
                    cache salt <= MAX_SALT_BYTES; chunk indices < 2**32 (the key holds 4 bytes);
                    token counts < 2**62; at most MAX_REFUSALS_REPLIED refusals in a reply
    per registration  segments <= MAX_SEGMENTS_PER_REGISTRATION (Linux passes 253 descriptors per
                    message); held lookups <= MAX_HELD_LOOKUPS_PER_REGISTRATION; salts remembered
                    <= engines.MAX_NAMESPACES (each <= MAX_SALT_BYTES)
    whole server    registrations <= --max-registrations; mapped segments <= MAX_MAPPED_SEGMENTS;
                    held lookups <= MAX_HELD_LOOKUPS

    scheduling      a lookup, store or retrieve runs in slices of at most SLICE_CHUNKS chunks (or blocks),
                    SLICE_BYTES copied and SLICE_INDEX_STEPS prefix-index steps; the control loop serves
                    its connections in turn, one slice each (service.py), at most
                    MAX_QUEUED_PER_CONNECTION requests queued per connection

A client's wait behind another's large request is about one slice per other busy connection
(a few milliseconds each), not the large request's whole time (tests/cache_server/test_fair_slicing.py
states and checks the bound; benchmarks/bench_server.py prints the worst wait it measured).
"""

from __future__ import annotations

from hybridkv.cache_server.registered_layout import RequestError
from hybridkv.wire import ErrorCode, LookupRequest, RetrieveRequest, StoreRequest

MAX_CHUNK_HASH_BYTES = 64  # a chunk hash (the client's are 16-byte xxh3-128 digests)
MAX_SALT_BYTES = 256  # a cache salt, UTF-8 bytes
MAX_CHUNKS_PER_REQUEST = 16384  # chunk hashes in one lookup or store (4M tokens at 256 per chunk)
MAX_REFUSALS_REPLIED = 64  # refusals listed in one store reply; the rest are counted
MAX_SEGMENTS_PER_REGISTRATION = 253  # SCM_MAX_FD: descriptors Linux passes in one message
MAX_MAPPED_SEGMENTS = 16384  # segments mapped for every registration together (vm.max_map_count is 65530)
MAX_HELD_LOOKUPS_PER_REGISTRATION = 1024  # lookups holding locks, per registration
MAX_HELD_LOOKUPS = 16384  # ... and in the whole server
CHUNK_INDEX_END = 1 << 32  # chunk indices are 4 bytes in an object key
TOKENS_END = 1 << 62  # num_tokens / skip_tokens
SLICE_CHUNKS = 256  # chunks of a lookup or store, or blocks of a retrieve, in one slice (~1-3 ms of Python)
SLICE_BYTES = 32 << 20  # bytes copied in one slice (~3-5 ms at memcpy speed)
# prefix-index steps (nodes visited, prefix_index.work_steps) in one slice of a store (~2-5 ms): a chain
# costs a few per chunk, but one chunk can cost its depth (a state that makes a long chain live at once)
SLICE_INDEX_STEPS = 1 << 13
MAX_QUEUED_PER_CONNECTION = 16  # requests a connection may have waiting (KVClient sends one at a time)


def _bad(message: str) -> RequestError:
    return RequestError(ErrorCode.BAD_REQUEST, message)


def check_hashes(what: str, hashes: list[bytes], parent_hash: bytes = b"") -> None:
    if len(hashes) > MAX_CHUNKS_PER_REQUEST:
        raise _bad(f"{what}: {len(hashes)} chunk hashes, at most {MAX_CHUNKS_PER_REQUEST} per request (send the "
                   "rest in another request)")
    for i, h in enumerate(hashes):
        if len(h) > MAX_CHUNK_HASH_BYTES:
            raise _bad(f"{what}: chunk hash {i} has {len(h)} bytes, expected at most {MAX_CHUNK_HASH_BYTES}")
    if len(parent_hash) > MAX_CHUNK_HASH_BYTES:
        raise _bad(f"{what}: parent_hash has {len(parent_hash)} bytes, expected at most {MAX_CHUNK_HASH_BYTES}")


def check_salt(what: str, salt: str) -> None:
    size = len(salt.encode("utf-8", "surrogatepass"))
    if size > MAX_SALT_BYTES:
        raise _bad(f"{what}: cache_salt has {size} bytes, expected at most {MAX_SALT_BYTES}")


def _check_tokens(what: str, name: str, value: int, low: int) -> None:
    if not low <= value < TOKENS_END:
        raise _bad(f"{what}: {name} must be in [{low}, 2**62), got {value}")


def check_store(req: StoreRequest) -> None:
    check_hashes("store", req.chunk_hashes, req.parent_hash)
    check_salt("store", req.cache_salt)
    end = req.first_chunk + len(req.chunk_hashes)
    if req.first_chunk < 0 or end > CHUNK_INDEX_END:
        raise _bad(f"store: chunks {req.first_chunk}..{end - 1} must lie in [0, 2**32) (first_chunk >= 0, "
                   f"first_chunk + {len(req.chunk_hashes)} chunk hashes <= 2**32), got first_chunk {req.first_chunk}")


def check_lookup(req: LookupRequest) -> None:
    check_hashes("lookup", req.chunk_hashes)
    check_salt("lookup", req.cache_salt)
    _check_tokens("lookup", "num_tokens", req.num_tokens, 0)


def check_retrieve(req: RetrieveRequest) -> None:
    if req.num_tokens != -1:
        _check_tokens("retrieve", "num_tokens", req.num_tokens, 0)
    _check_tokens("retrieve", "skip_tokens", req.skip_tokens, 0)
