"""The server's store: registered engines, the L1 pool, the L2 tiers and the rules of
docs/design.md §6 (store a chunk per object group; lookup = the longest prefix every object
group serves, never the last token; retrieve only what each object group needs).

One lock serialises every operation (the control loop and the HTTP thread both call in); page
copies run under it at memcpy speed. Every public method raises `RequestError` on bad input
before it changes anything.

Lookup, store and retrieve also come as steps (`*_steps`: generators that yield between bounded
slices of work, limits.SLICE_CHUNKS chunks or limits.SLICE_BYTES copied), so the control loop can
serve other clients between the slices of a large request (service.py). The lock is held per slice,
never across a yield, and each slice checks again that the registration still exists; a retrieve
takes its lookup's locks over at its first slice, so nothing it reads can be evicted in between.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from hybridkv.cache_server import limits
from hybridkv.cache_server.engines import Engine, EngineRegistry, Registered, access_buffers
from hybridkv.cache_server.hits import BlockCopy, first_needed, longest_hit_steps, plan_retrieve, retrieved_tokens
from hybridkv.cache_server.keys import object_key
from hybridkv.cache_server.l1_eviction import make_policy
from hybridkv.cache_server.l2 import TierSet
from hybridkv.cache_server.l2_sizing import SizerStats
from hybridkv.cache_server.leases import Lease, Leases
from hybridkv.cache_server.metrics import ServerMetrics
from hybridkv.cache_server.pool import L1Pool, listeners
from hybridkv.cache_server.prefix_index import ObjectPlace, PrefixIndex
from hybridkv.cache_server.registered_layout import (
    ChunkRules,
    ObjectGroup,
    object_group_infos,
    object_groups,
    validate_layout,
)
from hybridkv.cache_server.results import ClearResult, LookupResult, RetrieveResult, StoreResult
from hybridkv.cache_server.shm import Bytes
from hybridkv.cache_server.store_config import ObjectGroupMode, StoreConfig
from hybridkv.cache_server.tier_events import TierEvents
from hybridkv.cache_server.tiers.base import L2Tier
from hybridkv.wire import Layout, LookupRequest, Refusal, RegistrationAccess, RetrieveRequest, StoreRequest

__all__ = ["KVStore", "ObjectGroupMode", "StoreConfig"]  # the last two live in store_config.py

L2_FLUSH_TIMEOUT_S = 10.0
_NULL = "\0null"  # _store_object: only null blocks sent (not a refusal by itself)

T = TypeVar("T")
Steps = Generator[None, None, T]  # one slice of work per next(); the result when it stops


def run_steps(steps: Steps[T]) -> T:
    """Run every slice of `steps` now; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


class KVStore:
    def __init__(self, config: StoreConfig, tiers: Sequence[L2Tier] = (), metrics: ServerMetrics | None = None,
                 *, events: TierEvents | None = None) -> None:
        self.config = config
        self.metrics = metrics or ServerMetrics()
        self.metrics.l1_capacity.set(config.l1_bytes)
        self.tiers = TierSet(tiers, self.metrics, config.l2_sizing, events)
        index = PrefixIndex()
        self._pool = L1Pool(config.l1_bytes, make_policy(config.eviction_policy, index), index=index,
                            on_evict=lambda _k, _n: self.metrics.evictions.inc(),
                            can_reuse=self._l2_has_everything if len(self.tiers) else None,
                            listener=listeners(self.tiers if self.tiers.sized else None, events))
        self.metrics.watch_tiers(self.tiers.stats, self._sized_tiers)
        self._engines = EngineRegistry(config.max_registrations)
        self._leases = Leases(self._pool.unlock, self.metrics.lock_expired.inc)
        self._lock = threading.Lock()

    # ---- registration -----------------------------------------------------------------------

    def register(self, layout: Layout, fds: Sequence[int] = (), *, access: RegistrationAccess = RegistrationAccess.COPY,
                 owner: int | None = None) -> Registered:
        """Map the engine's segments (`fds`: one per distinct segment label; the caller closes them)
        and register it; `owner`: the registration connection whose closing releases it."""
        validate_layout(layout, self.config.chunk_tokens)
        with self._lock:
            self._engines.check_room(len(fds))  # before mapping anything
        buffers = access_buffers(layout, fds, access)
        separate = self.config.object_groups is ObjectGroupMode.SEPARATE
        try:
            groups = object_groups(layout, self.config.chunk_tokens, separate=separate)
            with self._lock:
                engine = self._engines.add(layout=layout, rules=ChunkRules(layout, self.config.chunk_tokens),
                                           groups=groups, buffers=buffers, owner=owner)
                self.metrics.engines.set(len(self._engines))
        except BaseException:
            if buffers is not None:
                buffers.close()
            raise
        return Registered(instance_id=engine.instance_id, token=engine.token, object_groups=object_group_infos(groups))

    def unregister(self, instance_id: int, token: str) -> None:
        with self._lock:
            self._engines.get(instance_id, token, None)
            self._unregister(instance_id)

    def release_owner(self, owner: int) -> int:
        """Drop every registration made on connection `owner` (it closed); how many there were."""
        with self._lock:
            doomed = self._engines.owned_by(owner)
            for instance_id in doomed:
                self._unregister(instance_id)
                self.metrics.leases_released.inc()
            return len(doomed)

    def _unregister(self, instance_id: int) -> None:
        self._leases.release_instance(instance_id)
        self._engines.remove(instance_id)
        self.metrics.engines.set(len(self._engines))

    def _engine(self, instance_id: int, token: str, fingerprint: str | None) -> Engine:
        return self._engines.get(instance_id, token, fingerprint)

    def _key(self, engine: Engine, og: ObjectGroup, salt: str, chunk: int, chunk_hash: bytes) -> bytes:
        return object_key(engine.namespace(og, salt), chunk, chunk_hash)

    # ---- store ------------------------------------------------------------------------------

    def store(self, req: StoreRequest) -> StoreResult:
        return run_steps(self.store_steps(req))

    def store_steps(self, req: StoreRequest) -> Steps[StoreResult]:
        with self._lock:
            self._leases.expire()
            engine = self._engine(req.instance_id, req.token, req.fingerprint)
            limits.check_store(req)
            engine.check_block_ids(req.block_ids, len(req.chunk_hashes), "store")
            self.metrics.store_requests.inc()
            self.tiers.begin_store()
            parent = req.parent_hash if req.first_chunk and req.parent_hash else None
            self._link_chain(engine, req.cache_salt, req.first_chunk, parent, req.chunk_hashes)
        stored, refusals, pinned = list[bool](), list[Refusal](), list[bytes]()
        copied = [0] * len(engine.groups)
        try:
            while len(stored) < len(req.chunk_hashes):
                if stored:
                    yield
                with self._lock:
                    engine = self._engine(req.instance_id, req.token, req.fingerprint)  # still registered
                    end, before = min(len(req.chunk_hashes), len(stored) + limits.SLICE_CHUNKS), sum(copied)
                    work = self._pool.index.work_steps
                    while len(stored) < end and sum(copied) - before < limits.SLICE_BYTES and \
                            self._pool.index.work_steps - work < limits.SLICE_INDEX_STEPS:
                        self._store_chunk(engine, req, len(stored), copied, pinned, stored, refusals)
        finally:
            with self._lock:
                for key in pinned:  # the request's own objects could not evict each other (see _store_object)
                    self._pool.unlock(key)
                self._update_gauges()
        replied = refusals[:limits.MAX_REFUSALS_REPLIED]
        return StoreResult(stored=stored, refusals=replied, refusals_left_out=len(refusals) - len(replied),
                           object_group_bytes=copied)

    def _store_chunk(self, engine: Engine, req: StoreRequest, i: int, copied: list[int], pinned: list[bytes],
                     stored: list[bool], refusals: list[Refusal]) -> None:
        chunk, chunk_hash = req.first_chunk + i, req.chunk_hashes[i]
        outcomes = [(og, self._store_object(engine, og, req, i, chunk_hash, copied, pinned)) for og in engine.groups]
        failed = [Refusal(chunk=chunk, object_group=og.name, reason=r) for og, r in outcomes if r and r is not _NULL]
        if not failed and all(r is _NULL for _, r in outcomes):
            failed = [Refusal(chunk=chunk, object_group=og.name, reason=self._refuse(
                og, "null_blocks", "every block id of this chunk is the null block 0: nothing to store"))
                for og in engine.groups[:1]]
        refusals.extend(failed)
        stored.append(not failed)
        if not failed:
            self.metrics.chunks_stored.inc()

    def _store_object(self, engine: Engine, og: ObjectGroup, req: StoreRequest, i: int, chunk_hash: bytes,
                      copied: list[int], pinned: list[bytes]) -> str:
        """Commit chunk first_chunk + i of `og`: "" when committed or nothing is kept, `_NULL` when the
        engine sent only null blocks (a state group between checkpoints), else the refusal's reason.

        A committed object stays locked (`pinned`) until the request ends, so a store larger than L1
        cannot evict the chunks it already reported stored: it is refused from the first chunk that
        does not fit, and an immediate lookup hits exactly what the reply says."""
        chunk, rules = req.first_chunk + i, engine.rules
        pages: list[tuple[int, int]] = []  # (group, block id) in object order
        for gid in og.groups:
            bpc = rules.blocks_per_chunk[gid]
            pages.extend((gid, req.block_ids[gid][i * bpc + b]) for b in rules.kept(gid, chunk))
        null = [gid for gid, bid in pages if bid == 0]
        if not pages:
            return ""
        if len(null) == len(pages):
            self.metrics.objects_skipped.labels(og.name).inc()
            return _NULL
        if null:
            return self._refuse(og, "null_blocks", f"group {null[0]} has null blocks among the blocks it keeps")
        key = self._key(engine, og, req.cache_salt, chunk, chunk_hash)
        if self._pool.get(key) is not None:  # already stored: the same chained hash means the same content
            self._pool.lock(key)
            pinned.append(key)
            return ""
        buffers = engine.mapped("store")
        nbytes = rules.object_bytes(og, chunk)

        parent = req.chunk_hashes[i - 1] if i else (req.parent_hash or None) if chunk else None
        place = ObjectPlace(rules=engine.tree(req.cache_salt), chunk=chunk, chunk_hash=chunk_hash,
                            parent_hash=parent, object_group=og.index)

        def fill(value: Bytes) -> None:
            offset = 0
            for gid, bid in pages:
                for buffer, page in rules.layer_copies(gid):
                    value[offset:offset + page] = buffers.page(buffer, bid, page)
                    offset += page

        if not self._pool.put(key, nbytes, fill, place):
            return self._refuse(og, "l1_full", f"L1 cannot place {nbytes} bytes: the pool ({self.config.l1_bytes} "
                                "bytes) is full of locked objects, too small, or still writing evicted ones to L2")
        self.metrics.bytes_in.inc(nbytes)
        copied[og.index] += nbytes
        self.metrics.objects_stored.labels(og.name).inc()
        stored = self._pool.get(key)
        assert stored is not None  # just placed, under the lock
        self._pool.lock(key)
        pinned.append(key)
        self.tiers.write_behind(key, memoryview(stored.data), place)
        return ""

    def _link_chain(self, engine: Engine, salt: str, first_chunk: int, parent: bytes | None,
                    hashes: list[bytes]) -> None:
        tree = engine.tree(salt)
        self._pool.index.link_chain(tree, first_chunk, parent, hashes)
        self.tiers.link_chain(tree, first_chunk, parent, hashes)

    def _sized_tiers(self) -> list[tuple[str, SizerStats]]:
        """(name, what the server placed there) of each L2 tier it sizes (metrics scrape time)."""
        with self._lock:
            sized = self.tiers.sizer_stats()
        return [(name, z) for name, z in zip(self.tiers.names, sized, strict=True) if z is not None]

    def _l2_has_everything(self) -> bool:
        """Memory of evicted objects may be reused only once the write-behind handed it to L2."""
        if self.tiers.flush(timeout_s=L2_FLUSH_TIMEOUT_S):
            return True
        self.metrics.l2_errors.labels("write_behind").inc()
        return False

    def _refuse(self, og: ObjectGroup, reason: str, message: str) -> str:
        self.metrics.refused.labels(og.name, reason).inc()
        return message

    # ---- lookup -----------------------------------------------------------------------------

    def lookup(self, req: LookupRequest) -> LookupResult:
        return run_steps(self.lookup_steps(req))

    def lookup_steps(self, req: LookupRequest) -> Steps[LookupResult]:
        with self._lock:
            self._leases.expire()
            engine = self._engine(req.instance_id, req.token, req.fingerprint)
            self.metrics.lookups.inc()
            limits.check_lookup(req)
        max_chunks = min(len(req.chunk_hashes), max(0, req.num_tokens - 1) // self.config.chunk_tokens)
        hashes = req.chunk_hashes[:max_chunks]
        keys: list[list[bytes]] = [[] for _ in engine.groups]
        where: list[list[int | None]] = [[] for _ in engine.groups]
        for start in range(0, max_chunks, limits.SLICE_CHUNKS):  # keys and places, a slice of chunks at a time
            if start:
                yield
            with self._lock:
                engine = self._engine(req.instance_id, req.token, req.fingerprint)
                part = hashes[start:start + limits.SLICE_CHUNKS]
                part_keys = [[self._key(engine, og, req.cache_salt, start + j, h) for j, h in enumerate(part)]
                             for og in engine.groups]
                self._link_chain(engine, req.cache_salt, start, hashes[start - 1] if start else None, part)
                for o, found in enumerate(self._where(engine, part_keys, start)):
                    keys[o] += part_keys[o]
                    where[o] += found
        while True:  # the longest hit, locked (looking again while an object it counted is gone)
            present = [[w is not None for w in ws] for ws in where]
            hit, per_group = yield from longest_hit_steps(engine, present, len(hashes))
            locked = yield from self._lock_hit_steps(engine, keys, where, hit, req.cache_salt, hashes)
            if locked is not None:
                break
        with self._lock:
            try:
                self._engine(req.instance_id, req.token, req.fingerprint)  # still registered
                return self._hold(engine, req, hit, per_group, locked, hashes)
            except BaseException:
                for key in locked:
                    self._pool.unlock(key)
                raise

    def _hold(self, engine: Engine, req: LookupRequest, hit: int, per_group: list[int], locked: list[bytes],
              hashes: list[bytes]) -> LookupResult:
        lookup_id = 0
        if hit:
            self._leases.check_room(req.instance_id)
            lookup_id = self._leases.add(Lease(
                instance_id=req.instance_id, fingerprint=engine.layout.fingerprint, cache_salt=req.cache_salt,
                hashes=hashes[:hit], locked=locked, expires_at=time.monotonic() + self.config.lock_ttl_s))
        chunk = self.config.chunk_tokens
        self.metrics.lookup_hit_tokens.inc(hit * chunk)
        for og in engine.groups:
            self.metrics.hit_chunks.labels(og.name).inc(hit - first_needed(engine, og, hit))
        self._update_gauges()
        return LookupResult(lookup_id=lookup_id, hit_tokens=hit * chunk,
                            object_group_hit_tokens=[c * chunk for c in per_group])

    def _where(self, engine: Engine, keys: list[list[bytes]], first_chunk: int) -> list[list[int | None]]:
        """Per object group and chunk first_chunk + j: -1 in L1 (or an empty object), a tier index, or None."""
        where: list[list[int | None]] = []
        for og, og_keys in zip(engine.groups, keys, strict=True):
            where.append([-1 if k in self._pool or engine.rules.object_bytes(og, first_chunk + j) == 0 else None
                          for j, k in enumerate(og_keys)])
        if len(self.tiers):
            missing = [(o, j) for o, ws in enumerate(where) for j, w in enumerate(ws) if w is None]
            found = self.tiers.where([keys[o][j] for o, j in missing])
            for (o, j), tier in zip(missing, found, strict=True):
                where[o][j] = tier
        return where

    def _lock_hit_steps(self, engine: Engine, keys: list[list[bytes]], where: list[list[int | None]],
                        hit: int, salt: str, hashes: list[bytes]) -> Steps[list[bytes] | None]:
        """Lock every object the hit needs, a slice at a time, reading L2 objects into L1 first; None
        (with `where` updated and nothing left locked) when an object could not be had: look again."""
        needed = [(o, j) for o, og in enumerate(engine.groups) for j in range(first_needed(engine, og, hit), hit)
                  if engine.rules.object_bytes(og, j)]
        # L1 first (promotion must not evict them); tail first, so a chain's shared head is the most recently used
        order = sorted(needed, key=lambda n: (where[n[0]][n[1]] != -1, -n[1]))
        locked: list[bytes] = []
        for start in range(0, len(order), limits.SLICE_CHUNKS):
            if start:
                yield
            with self._lock:
                for o, j in order[start:start + limits.SLICE_CHUNKS]:
                    key = keys[o][j]
                    place = ObjectPlace(rules=engine.tree(salt), chunk=j, chunk_hash=hashes[j],
                                        parent_hash=hashes[j - 1] if j else None, object_group=o)
                    # an L1 object may have been evicted between slices: then look again
                    if (where[o][j] != -1 and not self._promote(engine, place, key, where[o][j])) or \
                            not self._pool.lock(key):
                        where[o][j] = None
                        for k in locked:
                            self._pool.unlock(k)
                        return None
                    locked.append(key)
        return locked

    def _promote(self, engine: Engine, place: ObjectPlace, key: bytes, tier: int | None) -> bool:
        if tier is None:
            return False
        expected = engine.rules.object_bytes(engine.groups[place.object_group], place.chunk)
        value = self.tiers.get(tier, key, expected)
        if value is None:
            return False

        def fill(view: Bytes) -> None:
            view[:] = np.frombuffer(value, dtype=np.uint8)

        return self._pool.put(key, len(value), fill, place)

    # ---- retrieve, release ------------------------------------------------------------------

    def retrieve(self, req: RetrieveRequest) -> RetrieveResult:
        return run_steps(self.retrieve_steps(req))

    def retrieve_steps(self, req: RetrieveRequest) -> Steps[RetrieveResult]:
        """Copy the lookup's hit (or its first num_tokens) into the engine's blocks.
        The lookup is consumed (its locks released) whether or not the copy succeeds."""
        with self._lock:
            self._leases.expire()
            engine = self._engine(req.instance_id, req.token, req.fingerprint)
            limits.check_retrieve(req)
            self._held(engine, req.lookup_id)
            lease = self._leases.take(req.lookup_id)  # its locks are this retrieve's now
        per_group = [0] * len(engine.groups)
        try:
            with self._lock:
                tokens, plan = self._plan_retrieve(engine, lease, req)
            copies: list[BlockCopy] = []
            more = True
            while more:  # the plan, checked whole before any copy, a slice of chunks at a time
                with self._lock:
                    for _ in range(limits.SLICE_CHUNKS):
                        part = next(plan, None)
                        if part is None:
                            more = False
                            break
                        copies += part
                if more:
                    yield
            done = 0
            while done < len(copies):
                if done:
                    yield
                with self._lock:
                    buffers = self._engine(req.instance_id, req.token, req.fingerprint).mapped("retrieve")
                    end, before = min(len(copies), done + limits.SLICE_CHUNKS), sum(per_group)
                    while done < end and sum(per_group) - before < limits.SLICE_BYTES:
                        c, done = copies[done], done + 1
                        offset = c.offset
                        for buffer, page in engine.rules.layer_copies(c.group):
                            buffers.page(buffer, c.block, page)[:] = c.value[offset:offset + page]
                            offset += page
                        per_group[c.object_group] += offset - c.offset
        finally:
            with self._lock:
                for key in lease.locked:
                    self._pool.unlock(key)
        self.metrics.retrieves.inc()
        self.metrics.bytes_out.inc(sum(per_group))
        return RetrieveResult(tokens=tokens, bytes_copied=sum(per_group), object_group_bytes=per_group)

    def _plan_retrieve(self, engine: Engine, lease: Lease,
                       req: RetrieveRequest) -> tuple[int, Iterator[list[BlockCopy]]]:
        tokens = retrieved_tokens(req, len(lease.hashes), self.config.chunk_tokens)
        hit = tokens // self.config.chunk_tokens
        engine.check_block_ids(req.block_ids, hit, "retrieve")

        def value_of(og: ObjectGroup, j: int) -> Bytes | None:
            self.metrics.retrieved_chunks.labels(og.name).inc()
            return self._pool.get(self._key(engine, og, lease.cache_salt, j, lease.hashes[j]))

        return tokens, plan_retrieve(engine, hit, req, value_of)

    def release(self, instance_id: int, token: str, lookup_id: int) -> None:
        with self._lock:
            self._held(self._engine(instance_id, token, None), lookup_id)
            self._leases.release(lookup_id)

    def _held(self, engine: Engine, lookup_id: int) -> Lease:
        """The lease of `lookup_id`, made by a registration of `engine`'s layout (the same one, or the
        scheduler of the same vLLM engine in another process)."""
        return self._leases.held(lookup_id, fingerprint=engine.layout.fingerprint, instance_id=engine.instance_id)

    # ---- housekeeping -----------------------------------------------------------------------

    def clear(self) -> ClearResult:
        """Drop every object of L1 and every L2 tier (held lookups are released)."""
        with self._lock:
            self._leases.release_all()
            problems = self.tiers.clear()  # first: it flushes the write-behind, which reads L1 memory
            removed = self._pool.clear()
            self._update_gauges()
            return ClearResult(objects_removed=removed, problems=problems)

    def evict_one(self) -> bytes | None:
        """Evict L1's first unlocked object (tests and memory pressure); its key or None."""
        with self._lock:
            return self._pool.evict_one()

    def _update_gauges(self) -> None:
        stats = self._pool.stats()
        self.metrics.l1_bytes.set(stats.bytes_used)
        self.metrics.l1_objects.set(stats.objects)
        self.metrics.l1_resumable_prefixes.set(stats.prefixes.resumable_prefixes)
        self.metrics.l1_dead_objects.set(stats.prefixes.dead_objects)
        self.metrics.l1_dead_bytes.set(stats.prefixes.dead_bytes)
        self.metrics.bytes_by_kind.labels("state").set(stats.prefixes.state_bytes)
        self.metrics.bytes_by_kind.labels("attention").set(stats.prefixes.attention_bytes)

    def check_integrity(self) -> None:
        with self._lock:
            self._pool.check_integrity()
            self.tiers.check_integrity()

    def status(self, *, detail: bool = True) -> dict[str, Any]:
        """The server's state; without `detail` (a caller that did not authenticate to a server with a
        secret) no engine's model, fingerprint or layout, only how many are registered."""
        with self._lock:
            pool = self._pool.stats()
            engines = [e.describe() for e in self._engines.values()] if detail else []
            registered = len(self._engines)
            held = len(self._leases)
            sized = self.tiers.sizer_stats()
        tiers = [pool.describe()]
        return {"chunk_tokens": self.config.chunk_tokens, "object_groups": self.config.object_groups.value,
                "eviction_policy": self.config.eviction_policy.value, "l2_sizing": self.config.l2_sizing.value,
                "held_lookups": held,
                "registered_engines": registered, "engines": engines, "tiers": tiers + self.tiers.describe(sized)}

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what the write-behind still holds, close the tiers and unmap every engine's buffers."""
        self.tiers.close(timeout_s)
        with self._lock:
            self._engines.close()
