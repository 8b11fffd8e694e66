"""The registered engines: who may act on a registration, its mapped buffers, its lease, the cap.

A registration is made on the registration socket (registration.py) and bound two ways:

- to that connection, its lease: when it closes (the engine exited, was killed with -9, or its
  host process crashed) every registration it made is dropped and its buffers are unmapped;
- to a random `token` (128 bits) the register reply returns: every later request on the
  registration (lookup, store, retrieve, release, unregister) must carry it, so a client that
  learns another's `instance_id` (from `/status`, or by counting) can do nothing with it.

The number of registrations is capped (`max_registrations`); one over it is refused with LIMIT.
Each engine's per-salt key namespaces are a bounded cache (`MAX_NAMESPACES`), so a client that
sends a new cache salt with every request cannot grow the server's memory.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.cache_server.keys import namespace
from hybridkv.cache_server.limits import MAX_MAPPED_SEGMENTS
from hybridkv.cache_server.registered_layout import ChunkRules, ObjectGroup, RequestError, TreeRules
from hybridkv.cache_server.shm import MappedBuffers
from hybridkv.wire import ErrorCode, GroupKind, Layout, ObjectGroupInfo, RegistrationAccess

MAX_NAMESPACES = 4096  # per engine: (object group, cache salt) -> namespace, cleared when full


@dataclass(slots=True, kw_only=True)
class Engine:
    instance_id: int
    token: str
    layout: Layout
    rules: ChunkRules
    groups: list[ObjectGroup]
    buffers: MappedBuffers | None  # None: a lookup-only registration
    owner: int | None  # the registration connection (its lease); None: made in-process
    namespaces: dict[tuple[int, str], bytes] = field(default_factory=dict)
    segments: int = 0  # segments mapped for it
    trees: dict[str, TreeRules] = field(default_factory=dict)  # per cache salt

    def namespace(self, og: ObjectGroup, salt: str) -> bytes:
        ns = self.namespaces.get((og.index, salt))
        if ns is None:
            if len(self.namespaces) >= MAX_NAMESPACES:
                self.namespaces.clear()
            ns = self.namespaces[(og.index, salt)] = namespace(self.layout, og.name, salt)
        return ns

    def tree(self, salt: str) -> TreeRules:
        """The rules of this layout's prefix tree under `salt` (one tree per layout and salt, shared by
        every registration of the layout, as its objects are)."""
        rules = self.trees.get(salt)
        if rules is None:
            if len(self.trees) >= MAX_NAMESPACES:
                self.trees.clear()
            rules = self.trees[salt] = TreeRules(namespace(self.layout, "", salt), self.rules, self.groups, salt)
        return rules

    def describe(self) -> dict[str, Any]:
        """The registration as `/status` shows it to an authenticated caller."""
        layout = self.layout
        return {"instance_id": self.instance_id, "model": layout.model, "rank": layout.rank,
                "world_size": layout.world_size, "fingerprint": layout.fingerprint,
                "access": "copy" if self.buffers is not None else "lookup_only",
                "prefaulting": self.buffers is not None and self.buffers.prefaulting,
                "groups": [{"kind": g.kind.value, "num_layers": g.num_layers, "block_tokens": g.block_tokens,
                            "window_tokens": g.window_tokens, "page_bytes": g.page_bytes} for g in layout.groups],
                "object_groups": [{"name": og.name, "groups": list(og.groups)} for og in self.groups]}

    def check_block_ids(self, block_ids: list[list[int]], chunks: int, what: str) -> None:
        """BAD_REQUEST unless `block_ids` gives each cached group its blocks of `chunks` chunks, all mapped."""
        layout = self.layout
        if len(block_ids) != len(layout.groups):
            raise RequestError(ErrorCode.BAD_REQUEST, f"{what}: block_ids has {len(block_ids)} groups, the layout "
                               f"has {len(layout.groups)}")
        for gid, (g, ids) in enumerate(zip(layout.groups, block_ids, strict=True)):
            if g.kind is GroupKind.CROSS:
                continue
            expected = chunks * self.rules.blocks_per_chunk[gid]
            if len(ids) != expected:
                raise RequestError(ErrorCode.BAD_REQUEST, f"{what}: group {gid} has {len(ids)} block ids, expected "
                                   f"{expected} ({chunks} chunks of {self.rules.chunk_tokens} tokens / block size "
                                   f"{g.block_tokens})")
            self.mapped(what).check_block_ids(f"{what}, group {gid}", ids)

    def mapped(self, what: str) -> MappedBuffers:
        if self.buffers is None:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{what}: instance {self.instance_id} registered lookup-only "
                               "(no segments passed); register with the segments to store or retrieve")
        return self.buffers


@dataclass(frozen=True, slots=True, kw_only=True)
class Registered:
    instance_id: int
    token: str
    object_groups: list[ObjectGroupInfo]


class EngineRegistry:
    """Not thread-safe: the store calls it under its lock."""

    def __init__(self, max_registrations: int) -> None:
        self.max_registrations = max_registrations
        self._engines: dict[int, Engine] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._engines)

    def values(self) -> list[Engine]:
        return list(self._engines.values())

    def check_room(self, segments: int = 0) -> None:
        """LIMIT when one more registration, or `segments` more mapped segments, would pass a bound."""
        if len(self._engines) >= self.max_registrations:
            raise RequestError(ErrorCode.LIMIT, f"the server holds {len(self._engines)} registrations, its limit "
                               f"(--max-registrations {self.max_registrations}); unregister others or raise it")
        mapped = sum(e.segments for e in self._engines.values())
        if mapped + segments > MAX_MAPPED_SEGMENTS:
            raise RequestError(ErrorCode.LIMIT, f"the server maps {mapped} segments; {segments} more would pass its "
                               f"limit of {MAX_MAPPED_SEGMENTS}; unregister others first")

    def add(self, *, layout: Layout, rules: ChunkRules, groups: list[ObjectGroup], buffers: MappedBuffers | None,
            owner: int | None) -> Engine:
        self.check_room(buffers.segments if buffers is not None else 0)
        engine = Engine(instance_id=next(self._ids), token=secrets.token_hex(16), layout=layout, rules=rules,
                        groups=groups, buffers=buffers, owner=owner,
                        segments=buffers.segments if buffers is not None else 0)
        self._engines[engine.instance_id] = engine
        return engine

    def get(self, instance_id: int, token: str, fingerprint: str | None) -> Engine:
        """The engine, when `token` is its own; UNKNOWN_INSTANCE / UNAUTHORIZED / LAYOUT_MISMATCH else."""
        engine = self._engines.get(instance_id)
        if engine is None:
            raise RequestError(ErrorCode.UNKNOWN_INSTANCE, f"engine instance {instance_id} is not registered; "
                               "register again after a server restart")
        if not hmac.compare_digest(token.encode(), engine.token.encode()):
            raise RequestError(ErrorCode.UNAUTHORIZED, f"the token does not match instance {instance_id}'s "
                               "registration (only the client that registered it may act on it)")
        if fingerprint is not None and fingerprint != engine.layout.fingerprint:
            raise RequestError(ErrorCode.LAYOUT_MISMATCH, f"layout fingerprint {fingerprint!r} differs from the one "
                               f"instance {instance_id} registered ({engine.layout.fingerprint!r})")
        return engine

    def remove(self, instance_id: int) -> Engine:
        engine = self._engines.pop(instance_id)
        if engine.buffers is not None:
            engine.buffers.close()
        return engine

    def owned_by(self, owner: int) -> list[int]:
        return [i for i, e in self._engines.items() if e.owner == owner]

    def close(self) -> None:
        for instance_id in list(self._engines):
            self.remove(instance_id)


def access_buffers(layout: Layout, fds: Sequence[int], access: RegistrationAccess) -> MappedBuffers | None:
    """The mapped segments of a COPY registration; None (and no descriptor accepted) for LOOKUP_ONLY."""
    if access is RegistrationAccess.LOOKUP_ONLY:
        if fds:
            raise RequestError(ErrorCode.BAD_LAYOUT, f"a lookup-only registration passes no segments, got {len(fds)} "
                               "file descriptors")
        return None
    return MappedBuffers(layout, fds)
