"""Bad input on the control channel: every case gets an error reply (never silence), the server
keeps serving, and nothing already stored is lost or corrupted."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from hybridkv.cache_server.registered_layout import RequestError
from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.client import KVClient, ServerError, chunk_hashes, make_layout
from hybridkv.wire import ErrorCode, ErrorReply, LookupRequest, StoreRequest, decode_reply, encode
from tests.cache_server.helpers import FakeEngine, RunningServer, fake_engine, make_group, running_server

CHUNK = 8
GROUPS = [make_group(block=4, page=64), make_group(kind="sliding", block=4, window=9, page=64)]
TOKENS = list(range(4 * CHUNK + 1))


@contextlib.contextmanager
def raw_socket(server: RunningServer) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def ask(sock: zmq.Socket[bytes], payload: bytes | list[bytes]) -> ErrorReply:
    if isinstance(payload, list):
        sock.send_multipart(payload)
    else:
        sock.send(payload)
    assert sock.poll(5000), "no reply: the server left the client waiting"
    reply = decode_reply(sock.recv())
    assert isinstance(reply, ErrorReply)
    return reply


@pytest.fixture
def stored() -> Iterator[tuple[RunningServer, FakeEngine, KVClient]]:
    """A server holding 4 chunks of TOKENS from one engine."""
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20), max_message_bytes=4096) as server, \
            fake_engine(GROUPS) as eng, server.client() as client:
        client.register(eng.layout)
        reply = client.store(first_chunk=0, chunk_hashes=chunk_hashes(TOKENS, CHUNK),
                             block_ids=[list(range(1, 9)), list(range(11, 19))])
        assert reply.stored == [True] * 4
        yield server, eng, client
        # afterwards: still serving, and everything stored is intact
        full = [eng.page(0, 0, b).copy() for b in range(1, 9)]
        window = [eng.page(1, 0, b).copy() for b in (17, 18)]  # W=9: the last 8 tokens = chunk 3's blocks
        hit = client.lookup(chunk_hashes(TOKENS, CHUNK), num_tokens=len(TOKENS))
        assert hit.hit_tokens == 4 * CHUNK
        client.retrieve(hit.lookup_id, block_ids=[list(range(31, 39)), list(range(41, 49))])
        assert all(np.array_equal(eng.page(0, 0, b), ref) for b, ref in zip(range(31, 39), full, strict=True))
        assert all(np.array_equal(eng.page(1, 0, b), ref) for b, ref in zip((47, 48), window, strict=True))


def test_malformed_truncated_unknown_and_oversized(stored: tuple[RunningServer, FakeEngine, KVClient]) -> None:
    server, _, _ = stored
    with raw_socket(server) as sock:
        assert ask(sock, b"\xc1 not msgpack").code is ErrorCode.BAD_MESSAGE
        good = encode(LookupRequest(req_id=7, instance_id=1, fingerprint="x", chunk_hashes=[b"a" * 16], num_tokens=9))
        truncated = ask(sock, good[:-5])
        assert truncated.code is ErrorCode.BAD_MESSAGE
        unknown = ask(sock, msgspec.msgpack.encode({"op": "explode", "req_id": 9}))
        assert (unknown.code, unknown.req_id) == (ErrorCode.UNKNOWN_OP, 9) and "expected one of" in unknown.message
        missing = ask(sock, msgspec.msgpack.encode({"op": "lookup", "req_id": 10}))
        assert (missing.code, missing.req_id) == (ErrorCode.BAD_MESSAGE, 10)
        big = ask(sock, b"\x00" * 5000)
        assert big.code is ErrorCode.TOO_LARGE and "5000 bytes" in big.message
        assert ask(sock, [b"a", b"b"]).code is ErrorCode.BAD_MESSAGE
    assert server.metric("hybridkv_server_errors_total", code="bad_message") == 4


def test_unknown_instance_fingerprint_block_ids_and_counts(stored: tuple[RunningServer, FakeEngine, KVClient]) -> None:
    server, eng, client = stored
    hashes = chunk_hashes(TOKENS, CHUNK)
    with raw_socket(server) as sock:
        r = ask(sock, encode(LookupRequest(req_id=3, instance_id=999, fingerprint=eng.layout.fingerprint,
                                           chunk_hashes=hashes, num_tokens=33)))
        assert r.code is ErrorCode.UNKNOWN_INSTANCE and "999" in r.message
        reg = client.registration
        assert reg is not None
        r = ask(sock, encode(LookupRequest(req_id=4, instance_id=reg.instance_id, token=reg.token,
                                           fingerprint="another-layout", chunk_hashes=hashes, num_tokens=33)))
        assert r.code is ErrorCode.LAYOUT_MISMATCH and "another-layout" in r.message
    with pytest.raises(ServerError) as e:
        client.store(first_chunk=0, chunk_hashes=hashes[:1], block_ids=[[1, 128], [11, 12]])
    assert e.value.code is ErrorCode.BAD_REQUEST and "block id 128 is outside" in str(e.value)
    with pytest.raises(ServerError, match="group 1 has 1 block ids, expected 2"):
        client.store(first_chunk=0, chunk_hashes=hashes[:1], block_ids=[[1, 2], [11]])
    with pytest.raises(ServerError, match="block_ids has 1 groups"):
        client.store(first_chunk=0, chunk_hashes=hashes[:1], block_ids=[[1, 2]])
    # a rejected store changed nothing: the bad block ids above overwrote no object


def test_wrong_chunk_size_and_missing_shared_memory(stored: tuple[RunningServer, FakeEngine, KVClient]) -> None:
    server, _, _ = stored
    with fake_engine([make_group(block=16)]) as odd, server.client() as c:
        with pytest.raises(ServerError) as e:
            c.register(odd.layout)
        assert e.value.code is ErrorCode.BAD_LAYOUT
        assert "chunk size 8 must be a multiple of group 0's block size 16" in str(e.value)
        gone = make_layout(model="toy", groups=GROUPS, buffers=[*odd.buffers.buffer_layouts()[:0]], num_blocks=4,
                           page_stride_bytes=64)
        with pytest.raises(ServerError, match="only 0 buffers"):
            c.register(gone)
        label = odd.buffers.labels[0]  # a NUL byte in a segment label: a clear bad_layout, no traceback
        nul = make_layout(model="toy", groups=GROUPS, num_blocks=4, page_stride_bytes=64, buffers=[
            msgspec.structs.replace(b, shm_name="x\0y" if b.shm_name == label else b.shm_name)
            for b in odd.buffers.buffer_layouts()])
        with pytest.raises(RequestError) as err:
            server.store.register(nul, odd.buffers.fds)
        assert err.value.code is ErrorCode.BAD_LAYOUT and "no NUL" in str(err.value)


def test_client_disconnects_mid_store(stored: tuple[RunningServer, FakeEngine, KVClient]) -> None:
    server, eng, client = stored

    other = chunk_hashes([t + 1000 for t in TOKENS], CHUNK)
    reg = client.registration
    assert reg is not None
    for _ in range(5):  # send stores and vanish before the replies
        with raw_socket(server) as sock:
            sock.send(encode(StoreRequest(req_id=1, instance_id=reg.instance_id, token=reg.token,
                                          fingerprint=eng.layout.fingerprint, first_chunk=0,
                                          chunk_hashes=other, block_ids=[list(range(1, 9)), list(range(11, 19))])))
    hit = client.lookup(other, num_tokens=len(TOKENS))  # the server kept serving; each store was whole or nothing
    assert hit.hit_tokens in (0, 4 * CHUNK)
    if hit.lookup_id:
        client.release(hit.lookup_id)


def test_retrieved_bytes_intact_after_faults(stored: tuple[RunningServer, FakeEngine, KVClient]) -> None:
    server, eng, client = stored
    with raw_socket(server) as sock:
        ask(sock, b"garbage")
    before = [eng.page(0, 0, b).copy() for b in range(1, 9)]
    hit = client.lookup(chunk_hashes(TOKENS, CHUNK), num_tokens=len(TOKENS))
    client.retrieve(hit.lookup_id, block_ids=[list(range(51, 59)), list(range(61, 69))])
    for b, ref in zip(range(51, 59), before, strict=True):
        assert np.array_equal(eng.page(0, 0, b), ref)


HOSTILE = [
    b"\xa3\xff\xfe\xfd",  # a msgpack string that is not UTF-8
    b"\x91" * 100_000 + b"\xc0",  # 100,000 nested arrays
    b"\xdb\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",  # huge lengths
    msgspec.msgpack.encode({"op": ["unhashable"], "req_id": 1}),
    msgspec.msgpack.encode({"op": "lookup", "req_id": (1 << 64) - 1}),
    msgspec.msgpack.encode({"op": "lookup\udcff".encode("utf-8", "surrogatepass"), "req_id": 3}),
]



def test_hostile_frames_each_get_one_reply() -> None:
    with running_server() as server, raw_socket(server) as sock:  # 1 MiB messages: the deep nesting gets decoded
        for frame in HOSTILE:
            reply = ask(sock, frame)
            assert reply.code in {ErrorCode.BAD_MESSAGE, ErrorCode.UNKNOWN_OP}, (frame[:40], reply)
        assert not sock.poll(200), "a frame got more than one reply"
        assert server.store.metrics.internal_errors._value.get() == 0


def test_random_frames_each_get_one_reply_and_nothing_is_lost(
        stored: tuple[RunningServer, FakeEngine, KVClient]) -> None:
    server, _, _ = stored
    rng = random.Random(0)
    with raw_socket(server) as sock:
        for frame in (rng.randbytes(rng.randrange(0, 200)) for _ in range(300)):
            reply = ask(sock, frame)
            assert reply.code in {ErrorCode.BAD_MESSAGE, ErrorCode.UNKNOWN_OP}, (frame[:40], reply)
        assert not sock.poll(200), "a frame got more than one reply"
    assert server.store.metrics.internal_errors._value.get() == 0
