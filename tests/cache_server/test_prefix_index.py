"""The prefix index and the `resumable` eviction policy against a brute-force reference over paths.

The reference knows nothing of runs, users or links: a node is a tuple of chunk labels (its
path), a prefix is resumable when every object group's needed chunks along its path are present,
and an object is dead when no resumable prefix needs it."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache_server.l1_eviction import L1EvictionPolicyName, L1ResumablePolicy
from hybridkv.cache_server.prefix_index import ObjectPlace, PrefixIndex
from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.client import chunk_hashes
from tests.cache_server.helpers import fake_engine, make_group, running_server

Path = tuple[int, ...]


@dataclass
class Rules:
    """Object groups by rule: "full" (all chunks), "w2" (a window of the last 2 chunks), "state" (the last),
    "c2" (chunked attention, windows of 2 chunks: the chunks since the last window start, none at one)."""

    kinds: tuple[str, ...]
    tree_id: bytes = b"tree"

    @property
    def num_object_groups(self) -> int:
        return len(self.kinds)

    @property
    def state_object_groups(self) -> frozenset[int]:
        return frozenset(o for o, kind in enumerate(self.kinds) if kind == "state")

    @property
    def full_object_groups(self) -> frozenset[int]:
        return frozenset(o for o, kind in enumerate(self.kinds) if kind == "full")

    def first_needed(self, object_group: int, hit_chunks: int) -> int:
        return {"full": 0, "w2": max(0, hit_chunks - 2), "state": hit_chunks - 1,
                "c2": hit_chunks // 2 * 2}[self.kinds[object_group]]

    def empty(self, object_group: int, chunk: int) -> bool:
        return False


def h(path: Path) -> bytes:
    return repr(path).encode()


def key(path: Path, og: int) -> bytes:
    return h(path) + b"#%d" % og


def place(rules: Rules, path: Path, og: int) -> ObjectPlace:
    return ObjectPlace(rules=rules, chunk=len(path) - 1, chunk_hash=h(path),
                       parent_hash=h(path[:-1]) if len(path) > 1 else None, object_group=og)


def naive(rules: Rules, present: set[tuple[Path, int]]) -> tuple[set[Path], set[tuple[Path, int]]]:
    """(resumable prefixes, dead objects) by brute force."""
    paths = {p[:i] for p, _ in present for i in range(1, len(p) + 1)}
    resumable = {p for p in paths if all((p[:c], o) in present for o in range(rules.num_object_groups)
                                         for c in range(rules.first_needed(o, len(p)) + 1, len(p) + 1))}
    needed = {(p[:c], o) for p in resumable for o in range(rules.num_object_groups)
              for c in range(rules.first_needed(o, len(p)) + 1, len(p) + 1)}
    return resumable, present - needed


KINDS = st.sampled_from([("full", "state"), ("full", "w2"), ("full", "w2", "state"), ("full",)])
PATHS = st.lists(st.integers(0, 1), min_size=1, max_size=5).map(tuple)
OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "drop", "touch"]), PATHS, st.integers(0, 2)),
               max_size=40)


@settings(max_examples=150, deadline=None)
@given(kinds=KINDS, ops=OPS)
def test_index_and_policy_match_brute_force(kinds: tuple[str, ...], ops: list[tuple[str, Path, int]]) -> None:
    rules = Rules(kinds)
    index = PrefixIndex()
    policy = L1ResumablePolicy(index)
    present: set[tuple[Path, int]] = set()
    recency: list[bytes] = []  # least recently used first
    for op, path, og in ops:
        og %= len(kinds)
        k = key(path, og)
        if op == "put" and (path, og) not in present:
            present.add((path, og))
            recency.append(k)
            policy.insert(k)
            index.insert(k, 10 * len(path), place(rules, path, og))
        elif op == "drop" and (path, og) in present:
            present.discard((path, og))
            recency.remove(k)
            policy.remove(k)
            index.remove(k)
        elif op == "touch" and (path, og) in present:
            recency.remove(k)
            recency.append(k)
            policy.touch(k)
            index.touch(k)
        index.check_integrity()
        resumable, dead = naive(rules, present)
        stats = index.stats()
        assert stats.resumable_prefixes == len(resumable)
        assert {k for k in index.dead_keys()} == {key(p, o) for p, o in dead}
        assert stats.dead_bytes == sum(10 * len(p) for p, _ in dead)
        order = list(policy.order())
        assert sorted(order) == sorted(key(p, o) for p, o in present)  # every object once
        assert set(order[:len(dead)]) == {key(p, o) for p, o in dead}  # dead objects first
        if len(order) > len(dead) and rules.state_object_groups:  # a unit: evicting it kills one resumable prefix
            first = next(po for po in present if key(*po) == order[len(dead)])
            after, _ = naive(rules, present - {first})
            assert len(resumable - after) == 1 and after <= resumable
        elif len(order) > len(dead):  # no units without a state: the least recently used live object
            dead_keys = {key(p, o) for p, o in dead}
            assert order[len(dead)] == next(k for k in recency if k not in dead_keys)


def test_unknown_parent_is_linked_by_a_later_chain() -> None:
    """A chunk stored without its parent's hash cannot be placed; a lookup's chain links it."""
    rules = Rules(("full",))
    index = PrefixIndex()
    index.insert(b"a", 1, place(rules, (0,), 0))
    orphan = ObjectPlace(rules=rules, chunk=1, chunk_hash=h((0, 1)), parent_hash=None, object_group=0)
    index.insert(b"b", 1, orphan)
    assert index.stats().resumable_prefixes == 1 and index.is_dead(b"b")
    index.link_chain(rules, 0, None, [h((0,)), h((0, 1))])
    assert index.stats().resumable_prefixes == 2 and not index.is_dead(b"b")
    index.check_integrity()


# ---- hand case through the server: full + state chunks into an L1 of six 64-byte objects ----------


def _hand_case(policy: str) -> tuple[list[int], float]:
    """A (2 chunks, state at its end) is stored and looked up; B (2 chunks, no state: a prefill that
    stopped mid-chunk) adds two objects no lookup can use; C (1 chunk + state) needs one slot.
    Returns the hits of A and C afterwards and the dead bytes."""
    chunk = 8
    groups = [make_group(block=8, page=64), make_group(kind="state", block=8, page=64)]
    config = StoreConfig(chunk_tokens=chunk, l1_bytes=6 * 64, eviction_policy=L1EvictionPolicyName(policy))
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(running_server(config))
        engine = stack.enter_context(fake_engine(groups))
        c = stack.enter_context(server.client())
        c.register(engine.layout)
        seqs = {name: [base + t for t in range(2 * chunk + 1)] for name, base in (("a", 0), ("b", 1000), ("c", 2000))}
        hashes = {name: chunk_hashes(s, chunk) for name, s in seqs.items()}
        assert c.store(first_chunk=0, chunk_hashes=hashes["a"], block_ids=[[1, 2], [0, 3]]).stored == [True, True]
        hit = c.lookup(hashes["a"], num_tokens=len(seqs["a"]))
        assert hit.hit_tokens == 2 * chunk
        c.release(hit.lookup_id)
        assert c.store(first_chunk=0, chunk_hashes=hashes["b"], block_ids=[[4, 5], [0, 0]]).stored == [True, True]
        assert server.store.status()["tiers"][0]["dead_bytes"] == 2 * 64  # B's attention: no state after it
        assert c.store(first_chunk=0, chunk_hashes=hashes["c"][:1], block_ids=[[6], [7]]).stored == [True]
        hits = []
        for name, n in (("a", 2), ("c", 1)):
            found = c.lookup(hashes[name][:n], num_tokens=n * chunk + 1)
            hits.append(found.hit_tokens)
            if found.lookup_id:
                c.release(found.lookup_id)
        server.store.check_integrity()
        return hits, server.store.status()["tiers"][0]["dead_bytes"]


def test_lru_keeps_useless_attention_resumable_keeps_the_prefix() -> None:
    # LRU evicts A's first attention chunk (the oldest object): A's other chunk and state stay, dead,
    # beside B's two chunks
    assert _hand_case("lru") == ([0, 8], 64 * 4)
    # resumable evicts B's dead chunk 0 first: A still hits; only B's chunk 1 is dead
    assert _hand_case("resumable") == ([16, 8], 64)


def test_a_wrong_parent_hash_changes_eviction_order_not_answers() -> None:
    """A client that names a wrong parent for chunk 1 only makes chunk 1 look dead to the index: the
    store still reports it stored and a lookup still hits both chunks (answers come from the objects)."""
    chunk = 8
    config = StoreConfig(chunk_tokens=chunk, l1_bytes=1 << 16, eviction_policy=L1EvictionPolicyName.RESUMABLE)
    with running_server(config) as server, fake_engine([make_group(block=8, page=64)]) as engine, \
            server.client() as c:
        c.register(engine.layout)
        tokens = list(range(2 * chunk + 1))
        hashes = chunk_hashes(tokens, chunk)
        assert c.store(first_chunk=0, chunk_hashes=hashes[:1], block_ids=[[1]]).stored == [True]
        reply = c.store(first_chunk=1, chunk_hashes=hashes[1:], block_ids=[[2]], parent_hash=b"not the parent")
        assert reply.stored == [True] and not reply.refusals
        l1 = server.store.status()["tiers"][0]
        assert (l1["resumable_prefixes"], l1["dead_objects"], l1["dead_bytes"]) == (1, 1, 64)
        assert c.lookup(hashes, num_tokens=len(tokens)).hit_tokens == 2 * chunk
        server.store.check_integrity()


# ---- long chains, orphans and links against a reference that walks paths ---------------------------


class LinkedReference:
    """The index's contract restated over paths, with what it knows of parents: a node knows its
    parent once a store named it (or a chain linked it), forgets it when the node goes (no object,
    no child), and a prefix's objects count only through the parents its node knows."""

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.present: dict[tuple[Path, int], int] = {}  # (path, object group) -> bytes
        self.linked: set[Path] = set()

    def nodes(self) -> set[Path]:
        nodes = {p for p, _ in self.present}
        todo = list(nodes)
        while todo:
            p = todo.pop()
            if p in self.linked and p[:-1] not in nodes:
                nodes.add(p[:-1])
                todo.append(p[:-1])
        self.linked &= nodes
        return nodes

    def put(self, path: Path, og: int, nbytes: int, *, parent_known: bool) -> None:
        self.present[(path, og)] = nbytes
        if parent_known and len(path) > 1:
            self.linked.add(path)

    def link(self, path: Path) -> None:
        nodes = self.nodes()
        for i in range(2, len(path) + 1):  # ascending, as a chain is read: a parent made here stays unlinked
            if path[:i] in nodes and path[:i] not in self.linked:
                self.linked.add(path[:i])
                nodes.add(path[:i - 1])

    def ancestry(self, p: Path) -> list[Path]:
        """p and the ancestors its node knows, nearest first."""
        out = [p]
        while out[-1] in self.linked:
            out.append(out[-1][:-1])
        return out

    def needs(self, p: Path) -> set[tuple[Path, int]]:
        """What a hit of p's length needs, among the nodes p knows."""
        known = {len(q) - 1: q for q in self.ancestry(p)}
        return {(known.get(c, ()), o) for o in range(self.rules.num_object_groups)
                for c in range(self.rules.first_needed(o, len(p)), len(p))}

    def resumable(self) -> set[Path]:
        return {p for p in self.nodes() if all(n in self.present for n in self.needs(p))}

    def owned(self, p: Path, resumable: set[Path]) -> list[tuple[Path, int]]:
        """The objects only p needs, walking up from p; a full-rule group stops at its first shared one."""
        need = {q: self.needs(q) for q in resumable}
        lows = [self.rules.first_needed(o, len(p)) for o in range(self.rules.num_object_groups)]
        shared = [False] * len(lows)
        out = []
        for m in self.ancestry(p):
            if len(m) - 1 < min(lows) or all(shared):
                break
            for o, lo in enumerate(lows):
                if len(m) - 1 < lo or shared[o]:
                    continue
                users = sum((m, o) in n for n in need.values())
                if (m, o) in self.present and users == 1:
                    out.append((m, o))
                elif users > 1 and lo == 0:
                    shared[o] = True
        return out


@pytest.mark.parametrize("seed", range(32))
def test_long_chains_orphans_and_links_match_a_path_reference(seed: int) -> None:
    """Random stores (with and without the parent's hash), evictions, touches and lookups' chain links
    on chains up to 40 chunks deep; every answer of the index compared after every step."""
    rng = random.Random(seed)
    kinds = [("full",), ("full", "state"), ("full", "w2"), ("full", "w2", "state"), ("w2",), ("full", "c2"),
             ("c2", "state"), ("w2", "state")][seed % 8]
    rules = Rules(kinds)
    index, ref = PrefixIndex(), LinkedReference(rules)
    paths: list[Path] = [()]
    for _ in range(400):
        op = rng.choice(["put", "put", "put", "put", "drop", "touch", "link"])
        if op == "put":  # mostly the next chunk of a recent chain, or its next object
            base = rng.choice(paths[-8:]) if rng.random() < 0.8 else rng.choice(paths)
            path = (*base, rng.randrange(2)) if not base or (len(base) < 40 and rng.random() < 0.6) else base
            missing = [o for o in range(len(kinds)) if (path, o) not in ref.present]
            if not missing:
                continue
            og = missing[0] if rng.random() < 0.7 else rng.choice(missing)
            paths.append(path)
            known = rng.random() < 0.85
            nbytes = rng.randrange(1, 100)
            index.insert(key(path, og), nbytes, ObjectPlace(
                rules=rules, chunk=len(path) - 1, chunk_hash=h(path),
                parent_hash=h(path[:-1]) if known and len(path) > 1 else None, object_group=og))
            ref.put(path, og, nbytes, parent_known=known)
        elif op in ("drop", "touch") and ref.present:
            path, og = rng.choice(sorted(ref.present))
            if op == "drop":
                index.remove(key(path, og))
                del ref.present[(path, og)]
            else:
                index.touch(key(path, og))
        elif op == "link":
            path = rng.choice(paths)
            index.link_chain(rules, 0, None, [h(path[:i]) for i in range(1, len(path) + 1)])
            ref.link(path)
        resumable = ref.resumable()
        needed = set().union(*(ref.needs(p) for p in resumable)) if resumable else set()
        dead = {po for po in ref.present if po not in needed}
        stats = index.stats()
        assert stats.resumable_prefixes == len(resumable)
        assert set(index.dead_keys()) == {key(*po) for po in dead}
        assert stats.dead_bytes == sum(ref.present[po] for po in dead)
        units = sorted(index.unit_keys())
        expected = [key(*po) for p in resumable for po in ref.owned(p, resumable)] if rules.state_object_groups else []
        assert units == sorted(expected)
    index.check_integrity()


@pytest.mark.parametrize("kinds", [("full",), ("full", "w2", "state")])
def test_a_chain_costs_linear_index_work(kinds: tuple[str, ...]) -> None:
    """n chunks stored one after another, each naming its parent, then evicted oldest first (LRU) or
    newest first: O(1) index steps per object, not O(depth) (which counted each new prefix in every
    ancestor, and recounted every run below an evicted chunk: 2,000 chunks, millions of steps)."""
    rules = Rules(kinds)
    for n, oldest_first in ((500, True), (2000, True), (2000, False)):
        index = PrefixIndex()
        path: Path = ()
        keys = []
        for c in range(n):
            path = (*path, c)
            for og, kind in enumerate(kinds):
                if kind != "state" or c == n - 1:  # a prefill saves its state at its end
                    keys.append(key(path, og))
                    index.insert(keys[-1], 1, place(rules, path, og))
        assert index.stats().resumable_prefixes == (n if kinds == ("full",) else 1)
        assert index.work_steps <= 8 * n * len(kinds), (n, index.work_steps)
        for k in keys if oldest_first else keys[::-1]:
            index.remove(k)
        assert index.stats().trees == 0
        assert index.work_steps <= 16 * n * len(kinds), (n, oldest_first, index.work_steps)
