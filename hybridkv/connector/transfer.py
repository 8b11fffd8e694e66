"""`ServerConnector`: both sides of the KV connector (base.py) over the hybridkv KV cache server.

    connector = ServerConnector(KVClient(url), layout, state_groups={2: StateSaves.AT_STEP_END})
    external = connector.get_num_new_matched_tokens(request, local_hit)    # scheduler side
    connector.update_state_after_alloc(request, tables, external)
    meta = connector.build_connector_meta([StepWork(...), ...])
    connector.start_load_kv(meta); connector.wait_for_load()                 # worker side
    ... forward pass ...
    connector.save_kv(meta); connector.wait_for_save()

Engine-agnostic: any engine whose block tables follow docs/design.md §7 (per group, pool-wide
block ids, table entry i = tokens [i*B, (i+1)*B)) uses it as it is; our engine does
(engine/llm.py), and so does the vLLM integration. Transfers are synchronous (the server copies pages between its pool
and the engine's shared memory while the call waits), so nothing stays in flight across steps.

What is saved: every chunk a step completes, in that step, with the blocks of every group as
they are after the forward pass (window blocks still live). A state group's page holds the
state after the last token it was written for, so a chunk's state is saved only where it is
known to be the state at the chunk's end: every boundary in `all` mode
(`StateSaves.EVERY_BOUNDARY`), only the step's last token in `align` mode
(`StateSaves.AT_STEP_END`); elsewhere the state group gets the null block and the server skips
it (a later hit cannot end there).

Failures: an unreachable server, a timeout or an error reply is logged once (and once more when
the server answers again), counted in `stats`, and turns into "no external hit" / "load failed"
/ "not saved". A circuit breaker keeps a dead or hung server from stalling the engine: after a
failure no call goes to the server for `retry_after_s`; then one `hello` with a short bound probes
it, and only an answer closes the breaker. A server with nothing listening costs the client's
`connect_timeout_s` (0.5 s) per probe, so it is probed every `retry_after_s` (it is used again soon
after it comes back); a server that is connected but does not answer (hung) costs the probe's
timeout, so while it stays so the wait doubles, up to 8x. The engine keeps serving and recomputes
what it could not load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from enum import Enum
from functools import partial
from typing import TypeVar

from hybridkv.connector.base import (
    BlockTables,
    ConnectorMeta,
    ConnectorRequest,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadSpec,
    SaveSpec,
    StepWork,
    TransferStats,
)
from hybridkv.connector.client import (
    KVClient,
    Registration,
    ServerError,
    ServerTimeout,
    ServerUnreachable,
    chunk_hashes,
)
from hybridkv.errors import ConfigError
from hybridkv.wire import ErrorCode, GroupKind, Layout, RegistrationAccess

__all__ = ["ServerConnector", "StateSaves"]

MAX_BACKOFF_FACTOR = 8  # a hung server is left alone for at most 8 x retry_after_s
PROBE_TIMEOUT_S = 1.0  # the bound of the `hello` that probes a failed server

log = logging.getLogger("hybridkv.connector")
T = TypeVar("T")


class StateSaves(Enum):
    """Which chunk ends a state group's pages are valid at after a step."""

    EVERY_BOUNDARY = "every_boundary"  # `all` mode: a checkpoint at every block boundary the step crossed
    AT_STEP_END = "at_step_end"  # `align` mode: only the state after the step's last token


class ServerConnector(KVConnectorScheduler, KVConnectorWorker):
    """One engine's connector to one KV cache server (one process holding both sides)."""

    def __init__(self, client: KVClient, layout: Layout, *, state_groups: dict[int, StateSaves] | None = None,
                 retry_after_s: float = 5.0, access: RegistrationAccess = RegistrationAccess.COPY) -> None:
        self.client = client
        self.layout = layout
        self.access = access
        self.state_groups = dict(state_groups or {})
        self.retry_after_s = retry_after_s
        self.stats = TransferStats()
        self.registration: Registration | None = None
        self._down_until = 0.0
        self._backoff_s = retry_after_s
        self._failing = False
        self._hashes: dict[str, tuple[int, list[bytes]]] = {}  # request -> (tokens hashed, chunk hashes)
        self._pending: dict[str, tuple[int, int, int]] = {}  # request -> (lookup id, server hit, local hit)
        self._loads: list[LoadSpec] = []
        self._no_external: set[str] = set()
        self._finished_loads: set[str] = set()
        self._finished_saves: set[str] = set()
        self._failed_loads: set[str] = set()
        self._refusal_logged = False
        self._try(self._register, "register")

    # ---- registration / health ------------------------------------------------------------

    def _register(self) -> None:
        try:
            self.registration = self.client.register(self.layout, access=self.access)
        except ServerError as e:
            if e.code is ErrorCode.BAD_LAYOUT:  # a configuration error: never retried
                raise ConfigError(f"the KV cache server at {self.client.endpoint} rejects this engine's layout: "
                                  f"{e}") from None
            raise

    @property
    def chunk_tokens(self) -> int:
        return self.registration.chunk_tokens if self.registration else 0

    @property
    def object_groups(self) -> list[str]:
        return [og.name for og in self.registration.object_groups] if self.registration else []

    @property
    def reachable(self) -> bool:
        """Whether the server is registered with and its breaker closed (the last call succeeded)."""
        return self.registration is not None and not self._failing

    def _available(self) -> bool:
        """Whether to call the server now: the breaker is closed, or its wait is over and a probe answers."""
        if self._failing:
            if time.monotonic() < self._down_until:
                return False
            probe = partial(self.client.hello, timeout_s=min(PROBE_TIMEOUT_S, self.client.timeout_s))
            if self._try(probe, "probe") is None:
                return False
        if self.registration is None:
            self._try(self._register, "register")
        return self.registration is not None and not self._failing

    def _try(self, call: Callable[[], T], what: str) -> T | None:
        """`call()`'s result; None on a server failure (logged once, then the breaker opens: the server is
        left alone for a while, longer each time a hung server times out again)."""
        try:
            result = call()
        except ServerError as e:
            self.stats.errors += 1
            hung = isinstance(e, ServerTimeout) and not isinstance(e, ServerUnreachable)
            if self._failing and hung:
                self._backoff_s = min(self._backoff_s * 2, self.retry_after_s * MAX_BACKOFF_FACTOR)
            else:
                self._backoff_s = self.retry_after_s
                log.warning("KV cache server %s: %s failed (%s); recomputing what it cannot load and retrying "
                            "in %.0f s", self.client.endpoint, what, e, self._backoff_s)
            self._down_until = time.monotonic() + self._backoff_s
            self._failing = True
            return None
        if self._failing:
            log.warning("KV cache server %s answers again", self.client.endpoint)
            self._failing = False
        return result

    # ---- scheduler side -------------------------------------------------------------------

    def _chunk_hashes(self, request: ConnectorRequest, num_tokens: int) -> list[bytes]:
        rid = request.request_id
        _, hashes = self._hashes.get(rid, (0, []))
        chunk = self.chunk_tokens
        if num_tokens // chunk > len(hashes):  # extend the chain from the last hash
            tokens = request.token_ids[len(hashes) * chunk: num_tokens // chunk * chunk]
            seed = int.from_bytes(hashes[-1], "little") if hashes else 0  # the chain goes on from its last hash
            hashes = hashes + chunk_hashes(tokens, chunk, seed=seed)
            self._hashes[rid] = (num_tokens, hashes)
        return hashes[: num_tokens // chunk]

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_local_hit_tokens: int) -> int:
        rid = request.request_id
        self._release_pending(rid)
        num_tokens = len(request.token_ids)
        if rid in self._no_external or not self._available():
            return 0
        hashes = self._chunk_hashes(request, num_tokens)
        if (num_tokens - 1) // self.chunk_tokens * self.chunk_tokens <= num_local_hit_tokens:
            return 0  # the server cannot beat the local hit
        salt = request.cache_salt or ""
        reply = self._try(lambda: self.client.lookup(hashes, num_tokens=num_tokens, cache_salt=salt), "lookup")
        if reply is None:
            return 0
        self.stats.lookups += 1
        if reply.hit_tokens <= num_local_hit_tokens:
            if reply.lookup_id:
                lookup_id = reply.lookup_id
                self._try(lambda: self.client.release(lookup_id), "release")
            return 0
        self._pending[rid] = (reply.lookup_id, reply.hit_tokens, num_local_hit_tokens)
        return reply.hit_tokens - num_local_hit_tokens

    def _release_pending(self, rid: str) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None and self.registration is not None and not self._failing:
            self._try(lambda: self.client.release(pending[0]), "release")  # (else it expires on the server)

    def update_state_after_alloc(self, request: ConnectorRequest, block_tables: BlockTables,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        if not num_external_tokens:
            self._release_pending(rid)
            return
        pending = self._pending.pop(rid, None)
        if pending is None or pending[1] - pending[2] != num_external_tokens:
            raise ConfigError(f"request {rid!r} was allocated {num_external_tokens} external tokens but the "
                              f"connector offered {0 if pending is None else pending[1] - pending[2]}")
        lookup_id, hit, local = pending
        tables = tuple(tuple(t[: hit // g.block_tokens]) if g.kind is not GroupKind.CROSS else ()
                       for t, g in zip(block_tables, self.layout.groups, strict=True))
        self._loads.append(LoadSpec(request_id=rid, lookup_id=lookup_id, skip_tokens=local,
                                    num_external_tokens=num_external_tokens, block_tables=tables))
        self.stats.external_hit_tokens += num_external_tokens

    def build_connector_meta(self, steps: Sequence[StepWork]) -> ConnectorMeta:
        loads, self._loads = tuple(self._loads), []
        saves = [s for s in (self._save_spec(w) for w in steps) if s is not None]
        return ConnectorMeta(loads=loads, saves=tuple(saves))

    def _save_spec(self, work: StepWork) -> SaveSpec | None:
        chunk = self.chunk_tokens
        if not chunk or self.registration is None:
            return None
        first, last = work.start // chunk, work.end // chunk  # chunks first .. last-1 end in (start, end]
        if last <= first:
            return None
        chain = self._chunk_hashes(work.request, work.end)
        hashes, parent = chain[first:last], chain[first - 1] if first else b""
        blocks: list[tuple[int, ...]] = []
        for gid, (table, g) in enumerate(zip(work.block_tables, self.layout.groups, strict=True)):
            if g.kind is GroupKind.CROSS:
                blocks.append(())
                continue
            bpc = chunk // g.block_tokens
            ids = list(table[first * bpc: last * bpc])
            if len(ids) != (last - first) * bpc:
                raise ConfigError(f"group {gid}'s block table of request {work.request.request_id!r} has "
                                  f"{len(table)} entries; chunks up to token {work.end} need {last * bpc}")
            if self.state_groups.get(gid) is StateSaves.AT_STEP_END:
                for j in range(first, last):  # only the state after the step's last token is known
                    if (j + 1) * chunk != work.end:
                        ids[(j - first + 1) * bpc - 1] = 0
            blocks.append(tuple(ids))
        return SaveSpec(request_id=work.request.request_id, first_chunk=first, chunk_hashes=tuple(hashes),
                        block_ids=tuple(blocks), cache_salt=work.request.cache_salt or "", parent_hash=parent)

    def request_finished(self, request_id: str, block_tables: BlockTables) -> bool:
        self._release_pending(request_id)
        self._hashes.pop(request_id, None)
        return False  # saves are synchronous: nothing in flight holds the blocks

    def request_load_failed(self, request_id: str) -> None:
        self._no_external.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request left the engine for good (finished, aborted)."""
        self.request_finished(request_id, ())
        self._no_external.discard(request_id)

    # ---- worker side ----------------------------------------------------------------------

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for load in meta.loads:
            reply = None
            if self._available():
                reply = self._try(partial(self.client.retrieve, load.lookup_id, block_ids=load.block_tables,
                                          skip_tokens=load.skip_tokens), "retrieve")
            if reply is None:
                self._failed_loads.add(load.request_id)
                self.stats.failed_loads += 1
                continue
            self.stats.loads += 1
            self.stats.loaded_bytes += reply.bytes_copied
            self._add_bytes(self.stats.loaded_bytes_by_group, reply.object_group_bytes)
            self._finished_loads.add(load.request_id)

    def wait_for_load(self) -> None:
        return None  # start_load_kv copies synchronously

    def save_kv(self, meta: ConnectorMeta) -> None:
        for save in meta.saves:
            if not self._available():
                self.stats.failed_saves += len(save.chunk_hashes)
                continue
            reply = self._try(partial(self.client.store, first_chunk=save.first_chunk, chunk_hashes=save.chunk_hashes,
                                      block_ids=save.block_ids, cache_salt=save.cache_salt,
                                      parent_hash=save.parent_hash), "store")
            if reply is None:
                self.stats.failed_saves += len(save.chunk_hashes)
                continue
            self.stats.saved_chunks += sum(reply.stored)
            self.stats.refused_chunks += len(reply.stored) - sum(reply.stored)
            if reply.refusals and not self._refusal_logged:
                self._refusal_logged = True
                first = reply.refusals[0]
                log.warning("KV cache server %s refused chunk %d of object group %s: %s (reported once)",
                            self.client.endpoint, first.chunk, first.object_group, first.reason)
            self._add_bytes(self.stats.saved_bytes_by_group, reply.object_group_bytes)
            self._finished_saves.add(save.request_id)

    def wait_for_save(self) -> None:
        return None  # save_kv copies synchronously

    def get_finished(self) -> tuple[set[str], set[str]]:
        saves, loads = self._finished_saves, self._finished_loads
        self._finished_saves, self._finished_loads = set(), set()
        return saves, loads

    def get_failed_loads(self) -> set[str]:
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    # ---- control --------------------------------------------------------------------------

    def clear(self) -> int:
        """Drop every object the server holds (every engine's); the number removed, -1 on failure."""
        removed = self._try(self.client.clear, "clear")
        return -1 if removed is None else removed

    def close(self) -> None:
        if self.registration is not None and not self._failing:  # (else closing the client ends the lease)
            self._try(self.client.unregister, "unregister")
        self.client.close()

    def _add_bytes(self, into: dict[str, int], per_group: Sequence[int]) -> None:
        for name, nbytes in zip(self.object_groups, per_group, strict=False):
            into[name] = into.get(name, 0) + nbytes
