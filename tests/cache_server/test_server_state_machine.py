"""Hypothesis state machine: store / lookup + retrieve / evict / clear on the server's store,
against a plain-dict model of what must be retrievable. The model computes hits token by
token (which positions each group reads), independently of the server's range arithmetic."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.cache_server.keys import namespace, object_key
from hybridkv.cache_server.l1_eviction import L1EvictionPolicyName
from hybridkv.cache_server.registered_layout import object_groups
from hybridkv.cache_server.store import KVStore, StoreConfig
from hybridkv.connector.client import chunk_hashes
from hybridkv.wire import GroupKind, LookupRequest, RetrieveRequest, StoreRequest
from tests.cache_server.helpers import make_engine, make_group

CHUNK = 8
GROUPS = [make_group(block=4, page=16), make_group(kind="sliding", block=4, window=13, page=16),
          make_group(kind="state", block=8, page=24), make_group(kind="chunked", block=2, window=12, page=8)]
BLOCKS = [CHUNK // g.block_tokens for g in GROUPS]
N_CHUNKS = 5
# three sequences sharing prefixes: B shares 2 chunks with A, C shares none
SEQS = [list(range(N_CHUNKS * CHUNK + 1)), [*range(2 * CHUNK), *range(900, 900 + 3 * CHUNK + 1)],
        list(range(500, 500 + N_CHUNKS * CHUNK + 1))]
SALTS = ["", "b"]


def base(gid: int) -> int:
    """First block id of group gid's blocks (a block id belongs to one group at a time)."""
    return 1 + gid * N_CHUNKS * max(BLOCKS)


def needed_tokens(g: object, hit: int) -> range:
    kind, w = g.kind, g.window_tokens  # type: ignore[attr-defined]
    if kind is GroupKind.FULL:
        return range(hit)
    if kind is GroupKind.SLIDING:
        return range(max(0, hit - w + 1), hit)
    if kind is GroupKind.STATE:
        return range(hit - 1, hit) if hit else range(0)
    return range(hit // w * w, hit)  # chunked


class ServerMachine(RuleBasedStateMachine):
    policy = L1EvictionPolicyName.LRU

    def __init__(self) -> None:
        super().__init__()
        self.src = make_engine(GROUPS, num_blocks=96, seed=1)
        self.dst = make_engine(GROUPS, num_blocks=96, seed=None)
        self.store = KVStore(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 22, eviction_policy=self.policy))
        src = self.store.register(self.src.layout, self.src.buffers.fds)
        dst = self.store.register(self.dst.layout, self.dst.buffers.fds)
        self.iid, self.src_token = src.instance_id, src.token
        self.dst_id, self.dst_token = dst.instance_id, dst.token
        self.ogs = object_groups(self.src.layout, CHUNK, separate=True)
        self.og_of = {gid: og for og in self.ogs for gid in og.groups}
        self.model: dict[bytes, dict[tuple[int, int, int], bytes]] = {}  # key -> (group, block pos, layer) -> page
        self.rng = np.random.default_rng(0)

    def teardown(self) -> None:
        self.store.close()
        self.src.close()
        self.dst.close()

    def key(self, gid: int, salt: str, seq: int, chunk: int) -> bytes:
        og = self.og_of[gid]
        return object_key(namespace(self.src.layout, og.name, salt), chunk, chunk_hashes(SEQS[seq], CHUNK)[chunk])

    @rule(seq=st.integers(0, 2), salt=st.sampled_from(SALTS), first=st.integers(0, N_CHUNKS - 1),
          n=st.integers(1, N_CHUNKS))
    def store_chunks(self, seq: int, salt: str, first: int, n: int) -> None:
        n = min(n, N_CHUNKS - first)
        self.src.fill_random(int(self.rng.integers(1 << 30)))  # fresh content: a re-store must keep the old
        ids = [[base(gid) + i for i in range(n * b)] for gid, b in enumerate(BLOCKS)]
        hashes = chunk_hashes(SEQS[seq], CHUNK)[first:first + n]
        result = self.store.store(StoreRequest(req_id=1, instance_id=self.iid, token=self.src_token,
                                               fingerprint=self.src.layout.fingerprint, first_chunk=first,
                                               chunk_hashes=hashes, block_ids=ids, cache_salt=salt))
        assert result.stored == [True] * n and not result.refusals
        for i in range(n):
            chunk = first + i
            for og in self.ogs:
                key = self.key(og.groups[0], salt, seq, chunk)
                if key in self.model:
                    continue
                pages = {}
                for gid in og.groups:
                    g = GROUPS[gid]
                    for b in self.store_kept(gid, chunk):
                        pages[(gid, b, 0)] = bytes(self.src.page(gid, 0, base(gid) + i * BLOCKS[gid] + b))
                        assert g.num_layers == 1
                if pages:
                    self.model[key] = pages

    def store_kept(self, gid: int, chunk: int) -> list[int]:
        """Blocks of `chunk` any later hit can read (model: union of needed over all hit lengths)."""
        g, bt = GROUPS[gid], GROUPS[gid].block_tokens
        out = set()
        for hit in range((chunk + 1) * CHUNK, (N_CHUNKS + 1) * CHUNK + 1, CHUNK):
            start = chunk * CHUNK
            out |= {(t - start) // bt for t in needed_tokens(g, hit) if start <= t < start + CHUNK}
        return sorted(out)

    def expected_hit(self, seq: int, salt: str) -> int:
        max_chunks = min(N_CHUNKS, (len(SEQS[seq]) - 1) // CHUNK)
        for c in range(max_chunks, -1, -1):
            hit = c * CHUNK
            if all(self.key(gid, salt, seq, t // CHUNK) in self.model
                   for gid, g in enumerate(GROUPS) for t in needed_tokens(g, hit)):
                return c
        raise AssertionError("a hit of 0 is always possible")

    @rule(seq=st.integers(0, 2), salt=st.sampled_from(SALTS))
    def lookup_and_retrieve(self, seq: int, salt: str) -> None:
        hashes = chunk_hashes(SEQS[seq], CHUNK)
        fp = self.dst.layout.fingerprint
        res = self.store.lookup(LookupRequest(req_id=2, instance_id=self.dst_id, token=self.dst_token, fingerprint=fp,
                                              chunk_hashes=hashes, num_tokens=len(SEQS[seq]), cache_salt=salt))
        c = self.expected_hit(seq, salt)
        assert res.hit_tokens == c * CHUNK
        if not c:
            assert res.lookup_id == 0
            return
        self.dst.zero()
        ids = [[base(gid) + i for i in range(c * b)] for gid, b in enumerate(BLOCKS)]
        self.store.retrieve(RetrieveRequest(req_id=3, instance_id=self.dst_id, token=self.dst_token, fingerprint=fp,
                                            lookup_id=res.lookup_id, block_ids=ids))
        for gid, g in enumerate(GROUPS):
            needed = {t // g.block_tokens for t in needed_tokens(g, c * CHUNK)}
            for pos in range(c * BLOCKS[gid]):
                page = bytes(self.dst.page(gid, 0, base(gid) + pos))
                if pos in needed:
                    chunk, b = divmod(pos, BLOCKS[gid])
                    assert page == self.model[self.key(gid, salt, seq, chunk)][(gid, b, 0)]
                else:
                    assert not any(page)

    @precondition(lambda self: bool(self.model))
    @rule()
    def evict(self) -> None:
        key = self.store.evict_one()
        assert key in self.model
        del self.model[key]

    @rule()
    def clear(self) -> None:
        self.store.clear()
        self.model.clear()

    @invariant()
    def accounting(self) -> None:
        self.store.check_integrity()
        status = self.store.status()
        l1 = status["tiers"][0]
        assert l1["objects"] == len(self.model)
        assert l1["bytes_used"] == sum(len(p) for pages in self.model.values() for p in pages.values())
        assert status["held_lookups"] == 0


TestServerMachine = ServerMachine.TestCase
TestServerMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


class ResumableServerMachine(ServerMachine):
    """The same model under `--eviction-policy resumable` (its prefix index recounted at every step)."""

    policy = L1EvictionPolicyName.RESUMABLE


TestResumableServerMachine = ResumableServerMachine.TestCase
TestResumableServerMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
