"""Which L1 objects can still produce a hit: the server's tree of chunks and its resumable prefixes.

Per (layout, cache salt) a tree of chunk nodes linked by their chained hashes: a store names the
parent of its first chunk (`StoreRequest.parent_hash`), later chunks of a store follow each other,
and a lookup links what it names. Per node and object group the index knows whether the object is
in L1 (or needs no bytes there), the run of present objects ending at the node (counted up to
what a hit ending there needs), and `users`: how
many resumable prefixes need the object.

    chunk:        0      1      2      3
    full:        [x]----[x]----[x]----[x]        a node at chunk j is a *resumable prefix* (the end of
    window:2            [x]    [x]    [x]        a hit of j+1 chunks) when every object group serves
    state:       [x]                  [x]        j+1 under its rule: full all chunks, a window of w
                  ^ resumable          ^ resumable    chunks the last w, a state the last one

An object that no resumable prefix needs is *dead*: no lookup can hit through it until another
object is stored (above: full and window of chunks 1-2 are live only through chunk 3's prefix).

Cost. A window or state object group's `users` are counts, kept by walking the window up from
each prefix that becomes (or stops being) resumable. A full object group's object is needed by
every resumable prefix below it, so counting those would walk to the root (a chain of n new chunks:
O(n^2)); instead a node knows how many of its children lead to a resumable prefix (`live_children`),
its full objects are needed when it is *live* (resumable, or a live child), and a change of
liveness walks up only while it changes an ancestor's liveness: storing a chain costs O(1) index
steps per chunk, amortized (`work_steps` counts them; the store slices by them).

Links and this index decide eviction order and what `/status` reports, never what a lookup
answers: a lookup checks the objects themselves. A client can only link nodes of its own layout
and salt, so a wrong parent hash costs that tenant's objects their place, nobody else's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.errors import IntegrityError


class PrefixRules(Protocol):
    """The hit rules of one tree: one registered layout and cache salt."""

    @property
    def tree_id(self) -> bytes: ...

    @property
    def num_object_groups(self) -> int: ...

    @property
    def state_object_groups(self) -> frozenset[int]:
        """The object groups holding a state: every resumable prefix owns its state object."""
        ...

    @property
    def full_object_groups(self) -> frozenset[int]:
        """The object groups whose every hit needs all its chunks (`first_needed` is always 0)."""
        ...

    def first_needed(self, object_group: int, hit_chunks: int) -> int:
        """The first chunk the object group needs for a hit of `hit_chunks` chunks (never less than for
        a shorter hit: a window only moves forward)."""
        ...

    def empty(self, object_group: int, chunk: int) -> bool:
        """Whether the object group keeps no bytes for this chunk (present without an object)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectPlace:
    """Where an L1 object sits in its tree."""

    rules: PrefixRules
    chunk: int
    chunk_hash: bytes
    parent_hash: bytes | None  # chunk - 1's hash; None: chunk 0, or not known
    object_group: int


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexStats:
    resumable_prefixes: int
    dead_objects: int
    dead_bytes: int
    trees: int
    state_bytes: int  # bytes of objects of state object groups
    attention_bytes: int  # bytes of every other placed object (attention: full, window, chunked)


@dataclass(slots=True, eq=False)
class _Node:
    tree: _Tree
    chunk: int
    chunk_hash: bytes
    parent: _Node | None
    keys: list[bytes | None]
    run: list[int]  # per object group: present objects ending here, going up, up to the need (see _run)
    users: list[int]  # per window or state object group: resumable prefixes that need this node's object
    children: dict[bytes, _Node] = field(default_factory=dict)
    live_children: int = 0  # children with a resumable prefix in their subtree
    resumable: bool = False

    @property
    def live(self) -> bool:
        """A resumable prefix in this subtree (itself included): its full objects are needed."""
        return self.resumable or self.live_children > 0


@dataclass(slots=True, eq=False)
class _Tree:
    rules: PrefixRules
    nodes: dict[tuple[int, bytes], _Node] = field(default_factory=dict)


class PrefixIndex:
    """Not thread-safe: the pool calls it under the store's lock."""

    def __init__(self) -> None:
        self._trees: dict[bytes, _Tree] = {}
        self._objects: dict[bytes, tuple[_Node, int, int]] = {}  # key -> (node, object group, bytes)
        self._dead: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._dead_bytes = 0
        self._state_bytes = 0
        self._attention_bytes = 0
        self._endpoints: OrderedDict[_Node, None] = OrderedDict()  # resumable prefixes, least recently used first
        self.work_steps = 0  # nodes visited so far (runs recomputed, users counted, liveness passed up)

    # ---- what the pool tells it ---------------------------------------------------------------

    def insert(self, key: bytes, nbytes: int, place: ObjectPlace | None) -> None:
        """A new L1 object (`place` None: not part of any tree, e.g. a test's bare pool)."""
        if place is None:
            return
        rules = place.rules
        if not 0 <= place.object_group < rules.num_object_groups:
            raise IntegrityError(f"prefix index: object group {place.object_group} out of range "
                                 f"[0, {rules.num_object_groups})")
        tree = self._trees.get(rules.tree_id)
        if tree is None:
            tree = self._trees[rules.tree_id] = _Tree(rules)
        node = self._node(tree, place.chunk, place.chunk_hash, place.parent_hash)
        o = place.object_group
        if node.keys[o] is not None:
            raise IntegrityError(f"prefix index: chunk {place.chunk} of object group {o} already has an object")
        node.keys[o] = key
        self._objects[key] = (node, o, nbytes)
        self._count_kind(node, o, nbytes)
        if not self._needed(node, o):
            self._dead[key] = None
            self._dead_bytes += nbytes
        self._refresh(node, o)

    def touch(self, key: bytes) -> None:
        entry = self._objects.get(key)
        if entry is None:
            return
        node, o, _ = entry
        states = node.tree.rules.state_object_groups
        if node.resumable and (o in states or not states):  # a state layout: a hit landed on this prefix
            self._endpoints.move_to_end(node)
        if key in self._dead:
            self._dead.move_to_end(key)

    def remove(self, key: bytes) -> None:
        entry = self._objects.pop(key, None)
        if entry is None:
            return
        node, o, nbytes = entry
        if key in self._dead:
            del self._dead[key]
            self._dead_bytes -= nbytes
        self._count_kind(node, o, -nbytes)
        node.keys[o] = None
        self._refresh(node, o)
        self._prune(node)

    def link_chain(self, rules: PrefixRules, first_chunk: int, parent_hash: bytes | None,
                   chunk_hashes: list[bytes]) -> None:
        """Chunks first_chunk.. of one request have these hashes: link known nodes whose parent was not known."""
        tree = self._trees.get(rules.tree_id)
        if tree is None:
            return
        for i, chunk_hash in enumerate(chunk_hashes):
            chunk = first_chunk + i
            node = tree.nodes.get((chunk, chunk_hash))
            parent = chunk_hashes[i - 1] if i else parent_hash
            if node is not None and node.parent is None and chunk > 0 and parent is not None:
                self._link(node, self._node(tree, chunk - 1, parent, None))

    # ---- what the eviction policy reads ---------------------------------------------------------

    def dead_keys(self) -> Iterator[bytes]:
        """Dead objects, least recently used first (stop iterating once the index changes)."""
        return iter(self._dead)

    def unit_keys(self) -> Iterator[bytes]:
        """Resumable prefixes of state layouts, least recently used first (a prefix's recency is its
        state's), each as the objects only it needs, tail first: evicting the first kills the prefix and
        leaves the rest dead. A full + window layout has no units: a prefix's window tail is shared with
        its neighbours, and whole chains eaten from the tail keep every inner window object, which only
        shorter prefixes need (measured: 0.94x LRU's hits); its objects go least recently used first."""
        for node in self._endpoints:
            if node.tree.rules.state_object_groups:
                yield from self._owned(node)

    def _owned(self, node: _Node) -> Iterator[bytes]:
        rules, hit = node.tree.rules, node.chunk + 1
        lows = [rules.first_needed(o, hit) for o in range(rules.num_object_groups)]
        shared = [False] * len(lows)  # a full-rule object group met an object other prefixes need: so do its parents
        sole = True  # `node` is the only resumable prefix in m's subtree (a full object group's users == 1)
        m: _Node | None = node
        while m is not None and m.chunk >= min(lows) and not all(shared):
            sole = sole and (m.live_children == 0 if m is node else not m.resumable and m.live_children == 1)
            for o, lo in enumerate(lows):
                if m.chunk < lo or shared[o]:
                    continue
                users = (1 if sole else 2) if o in rules.full_object_groups else m.users[o]
                key = m.keys[o]
                if key is not None and users == 1:
                    yield key
                elif users > 1 and lo == 0:
                    shared[o] = True
            m = m.parent

    def stats(self) -> IndexStats:
        return IndexStats(resumable_prefixes=len(self._endpoints), dead_objects=len(self._dead),
                          dead_bytes=self._dead_bytes, trees=len(self._trees), state_bytes=self._state_bytes,
                          attention_bytes=self._attention_bytes)

    def _count_kind(self, node: _Node, o: int, nbytes: int) -> None:
        if o in node.tree.rules.state_object_groups:
            self._state_bytes += nbytes
        else:
            self._attention_bytes += nbytes

    def is_dead(self, key: bytes) -> bool:
        return key in self._dead

    # ---- the tree -------------------------------------------------------------------------------

    def _node(self, tree: _Tree, chunk: int, chunk_hash: bytes, parent_hash: bytes | None) -> _Node:
        node = tree.nodes.get((chunk, chunk_hash))
        if node is None:
            k = tree.rules.num_object_groups
            node = tree.nodes[(chunk, chunk_hash)] = _Node(tree=tree, chunk=chunk, chunk_hash=chunk_hash, parent=None,
                                                           keys=[None] * k, run=[0] * k, users=[0] * k)
            for o in range(k):
                self._refresh(node, o)
        if node.parent is None and chunk > 0 and parent_hash is not None:
            self._link(node, self._node(tree, chunk - 1, parent_hash, None))
        return node

    def _link(self, node: _Node, parent: _Node) -> None:
        node.parent = parent
        parent.children[node.chunk_hash] = node
        if node.live:
            self._pass_up(node, 1)
        for o in range(node.tree.rules.num_object_groups):
            self._refresh(node, o)

    def _prune(self, node: _Node | None) -> None:
        """Drop nodes that hold no object and lead to none, from `node` up."""
        while node is not None and not node.children and all(k is None for k in node.keys):
            if node.resumable:
                self._set_resumable(node, False)
            tree, parent = node.tree, node.parent
            del tree.nodes[(node.chunk, node.chunk_hash)]
            if parent is not None:
                del parent.children[node.chunk_hash]
            if not tree.nodes:
                del self._trees[tree.rules.tree_id]
            node = parent

    def _present(self, node: _Node, o: int) -> bool:
        return node.keys[o] is not None or node.tree.rules.empty(o, node.chunk)

    def _refresh(self, start: _Node, o: int) -> None:
        """Recompute object group o's runs from `start` down its subtree, then whether each changed
        node is resumable (a node's answer depends only on its own runs)."""
        changed: list[_Node] = []
        stack = [start]
        while stack:
            n = stack.pop()
            self.work_steps += 1
            run = self._run(n, o, n.parent.run[o] if n.parent is not None else 0)
            if run == n.run[o] and n is not start:
                continue
            n.run[o] = run
            changed.append(n)
            stack.extend(n.children.values())
        for n in changed:
            self._evaluate(n)

    def _run(self, n: _Node, o: int, up: int) -> int:
        """Object group o's present objects ending at n, going up (`up`: its parent's run), counted up
        to what a hit ending at n needs; a full group's is all of them or 0. Capped so, a change far
        up stops changing runs below where no hit needs it (evicting a chain oldest first: O(1) per
        object), and exact for the test that matters: a run >= the need. Each run only needs its
        parent's, as a hit one chunk longer needs at most one chunk more (`first_needed` never
        decreases as the hit grows)."""
        if not self._present(n, o):
            return 0
        rules, hit = n.tree.rules, n.chunk + 1
        if o in rules.full_object_groups:
            return hit if up == n.chunk else 0  # the parent's run was all of its chunks
        return min(up + 1, hit - rules.first_needed(o, hit))

    def _evaluate(self, n: _Node) -> None:
        rules, hit = n.tree.rules, n.chunk + 1
        ok = all(n.run[o] >= hit - rules.first_needed(o, hit) for o in range(rules.num_object_groups))
        if ok != n.resumable:
            self._set_resumable(n, ok)

    def _set_resumable(self, n: _Node, flag: bool) -> None:
        delta = 1 if flag else -1
        was_live = n.live
        n.resumable = flag
        rules, hit = n.tree.rules, n.chunk + 1
        for o in range(rules.num_object_groups):
            if o in rules.full_object_groups:
                continue
            lo = rules.first_needed(o, hit)  # a window of the prefix's last chunks: a bounded walk
            m: _Node | None = n
            while m is not None and m.chunk >= lo:
                self.work_steps += 1
                self._add_user(m, o, delta)
                m = m.parent
        if n.live != was_live:
            self._live_changed(n)
            self._pass_up(n, delta)
        if flag:
            self._endpoints[n] = None
        else:
            del self._endpoints[n]

    def _pass_up(self, child: _Node, delta: int) -> None:
        """`child` became live (+1) or stopped being live (-1) under its parent, or was linked there
        live: count it in the parent's live children, and go on up while that changes liveness."""
        m = child.parent
        while m is not None:
            self.work_steps += 1
            was_live = m.live
            m.live_children += delta
            if m.live == was_live:
                return
            self._live_changed(m)
            m = m.parent

    def _live_changed(self, m: _Node) -> None:
        """m's full objects are needed now when m is live, dead otherwise."""
        for o in m.tree.rules.full_object_groups:
            key = m.keys[o]
            if key is None:
                continue
            nbytes = self._objects[key][2]
            if m.live:
                del self._dead[key]
                self._dead_bytes -= nbytes
            else:
                self._dead[key] = None
                self._dead_bytes += nbytes

    def _needed(self, m: _Node, o: int) -> bool:
        return m.live if o in m.tree.rules.full_object_groups else m.users[o] > 0

    def _add_user(self, m: _Node, o: int, delta: int) -> None:
        before = m.users[o]
        m.users[o] = before + delta
        key = m.keys[o]
        if key is None:
            return
        nbytes = self._objects[key][2]
        if before == 0:
            del self._dead[key]
            self._dead_bytes -= nbytes
        elif m.users[o] == 0:
            self._dead[key] = None
            self._dead_bytes += nbytes

    # ---- checks ---------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Recompute runs, resumable prefixes, users and dead objects from scratch and compare."""
        runs: dict[_Node, list[int]] = {}
        for tree in self._trees.values():
            for node in sorted(tree.nodes.values(), key=lambda n: n.chunk):
                runs[node] = [self._run(node, o, runs[node.parent][o] if node.parent is not None else 0)
                              for o in range(tree.rules.num_object_groups)]
        users = {n: [0] * len(r) for n, r in runs.items()}  # every object group's, full ones too
        endpoints = set()
        for n, r in runs.items():
            rules, hit = n.tree.rules, n.chunk + 1
            if all(r[o] >= hit - rules.first_needed(o, hit) for o in range(len(r))):
                endpoints.add(n)
                for o in range(len(r)):
                    m: _Node | None = n
                    while m is not None and m.chunk >= rules.first_needed(o, hit):
                        users[m][o] += 1
                        m = m.parent
        dead = {k for n in runs for o, k in enumerate(n.keys) if k is not None and not users[n][o]}
        live = {m for e in endpoints for m in _path(e)}
        wrong = [n.chunk for n in runs if n.run != runs[n] or n.resumable != (n in endpoints)
                 or n.live_children != sum(c in live for c in n.children.values())
                 or any(n.users[o] != u for o, u in enumerate(users[n]) if o not in n.tree.rules.full_object_groups)]
        dead_bytes = sum(self._objects[k][2] for k in dead)
        if wrong or dead != set(self._dead) or dead_bytes != self._dead_bytes or set(self._endpoints) != endpoints:
            raise IntegrityError(f"prefix index: nodes at chunks {wrong[:5]} disagree with a recount; "
                                 f"{len(self._dead)} dead objects ({self._dead_bytes} bytes), recounted {len(dead)} "
                                 f"({dead_bytes}); {len(self._endpoints)} resumable prefixes, recounted "
                                 f"{len(endpoints)}")
        known = {k for n in runs for k in n.keys if k is not None}
        if known != set(self._objects):
            raise IntegrityError(f"prefix index: {len(self._objects)} objects, {len(known)} placed in trees")
        state = sum(b for n, o, b in self._objects.values() if o in n.tree.rules.state_object_groups)
        attention = sum(b for _, _, b in self._objects.values()) - state
        if (state, attention) != (self._state_bytes, self._attention_bytes):
            raise IntegrityError(f"prefix index: {self._state_bytes} state and {self._attention_bytes} attention "
                                 f"bytes counted, recounted {state} and {attention}")


def _path(n: _Node | None) -> Iterator[_Node]:
    """n and its ancestors."""
    while n is not None:
        yield n
        n = n.parent
