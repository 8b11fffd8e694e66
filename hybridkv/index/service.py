"""The index service: registrations, the ingest thread, and the answer to a query.

Answer shape (Mooncake Conductor Indexer API, RFC #1403), per tenant, per instance:

    {"default": {"engine-0": {"longest_matched": 96, "GPU": 96, "CPU": 0, "DISK": 0,
                              "DP": {"0": 96}, "attention_matched": 160}}}

`longest_matched` is the JOINT hybrid hit (rules.py): what the engine's own lookup will find, so a
router compares instances by the prefix they can really skip. `attention_matched` is what an
attention-only index reports for the same instance (its full-attention blocks alone).
`events_seq` (with a subscriber) is the next sequence number the index expects from the instance's
publisher (the least over its DP ranks): everything the engine published before it is in the
answer, so a router that saw a larger number from the engine knows the answer is behind.

A KV cache server registered as type "hybridkv-server" (its tiers' events: cache_server/tier_events.py)
gets `CPU` / `DISK` (the hit its lookup would find in that tier) and `longest_matched` over both,
from the prompt's chunk ids (kv_events/chunk_ids.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.index.probe import HeldOrder, PromptBlocks, instance_hit
from hybridkv.index.seq_hash import seq_hash_chunks, token_bytes
from hybridkv.index.subscriber import Subscriber
from hybridkv.index.table import SERVER_MEDIA, SERVER_TYPE, Namespaces, PrefixTable, Registration, RegKey, server_group
from hybridkv.kv_events.chunk_ids import chunk_hash_chain, chunk_id, chunk_key
from hybridkv.kv_events.wire import EventBatch

__all__ = ["IndexFullError", "IndexService", "Query"]

MEDIA = ("GPU", "CPU", "DISK")


class IndexFullError(HybridKVError, ValueError):
    """The index holds as many registrations as it accepts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    """A validated `/query` (token_ids) or `/query_by_hash` (seq_hashes at `block_size`)."""

    model: str
    tenant_id: str = "default"
    lora_name: str | None = None
    instance_id: str | None = None
    cache_salt: str | None = None
    token_ids: Sequence[int] | None = None
    token_data: memoryview | None = None  # (token ids as little-endian u32 bytes: the HTTP fast path)
    seq_hashes: Sequence[int] | None = None
    block_size: int | None = None
    num_tokens: int | None = None  # query_by_hash: the prompt's length (the hit stops one short of it)


class IndexService:
    """Owns the table and the ingest thread; every method is thread-safe."""

    def __init__(self, *, max_blocks: int = 4_000_000, max_registrations: int = 1024,
                 probe_every_s: float = 2.0, dead_after_s: float = 10.0, subscribe: bool = True) -> None:
        self.lock = threading.Lock()
        self.table = PrefixTable(max_blocks=max_blocks, namespaces=Namespaces())
        self.max_registrations = max_registrations
        self.subscriber = (Subscriber(self.table.apply, self._reset, self.lock, probe_every_s=probe_every_s,
                                      dead_after_s=dead_after_s) if subscribe else None)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()

    def _reset(self, key: RegKey) -> None:
        reg = self.table.registrations.get(key)
        if reg is not None:
            self.table.clear(reg)

    # -- registrations ----------------------------------------------------------------------------

    def register(self, reg: Registration, endpoint: str | None, replay_endpoint: str | None) -> None:
        """Add (or replace) a registration; IndexFullError when the registry is full."""
        with self.lock:
            if reg.key not in self.table.registrations and len(self.table.registrations) >= self.max_registrations:
                raise IndexFullError(f"the index holds {len(self.table.registrations)} registrations, the most it "
                                 f"accepts (--max-registrations); unregister one first")
            self.table.add(reg)
        if self.subscriber is not None and endpoint is not None:
            self.subscriber.add(reg.key, endpoint, replay_endpoint)

    def unregister(self, tenant_id: str, instance_id: str, dp_rank: int | None) -> list[str]:
        """Remove the matching registrations (every DP rank when `dp_rank` is None); their names."""
        removed = []
        with self.lock:
            for key in list(self.table.registrations):
                if key[0] == tenant_id and key[1] == instance_id and (dp_rank is None or key[2] == dp_rank):
                    self.table.drop(key)
                    removed.append(key)
        for key in removed:
            if self.subscriber is not None:
                self.subscriber.remove(key)
        return [f"{i}|{t}|{r}" for t, i, r in removed]

    def apply(self, key: RegKey, batch: EventBatch) -> None:
        """Apply a batch directly (tests, in-process publishers)."""
        with self.lock:
            self.table.apply(key, batch)

    # -- queries ----------------------------------------------------------------------------------

    def query(self, q: Query) -> dict[str, dict[str, dict[str, Any]]]:
        with self.lock:
            return {q.tenant_id: self._answer(q)}

    def _answer(self, q: Query) -> dict[str, dict[str, Any]]:
        table = self.table
        regs = [r for r in table.registrations.values()
                if r.key[0] == q.tenant_id and r.model == q.model and (q.lora_name or None) == (r.lora_name or None)
                and (q.instance_id is None or r.key[1] == q.instance_id)]
        answer: dict[str, dict[str, Any]] = {}
        for reg in regs:
            entry = answer.setdefault(reg.key[1], {"longest_matched": 0, **dict.fromkeys(MEDIA, 0), "DP": {},
                                                   "attention_matched": 0})
            if self.subscriber is not None:
                seq = self.subscriber.next_seq(reg.key)
                entry["events_seq"] = min(entry.get("events_seq", seq), seq)
        servers = [r for r in regs if r.kind == SERVER_TYPE]
        regs = [r for r in regs if r.kind != SERVER_TYPE]
        max_tokens = self._max_tokens(q)
        if servers:
            self._answer_servers(answer, q, servers, max_tokens)
        cid = table.context_id(q.model, q.lora_name, table.namespaces.of(q.cache_salt))
        if cid is None or not regs:
            return answer
        blocks = self._blocks(cid, q, regs)
        for reg in regs:
            groups = [(rule, 1 << reg.slots[g] if g in reg.slots else 0) for g, rule in sorted(reg.groups.items())]
            joint, attention = instance_hit(groups, blocks, max_tokens)
            entry = answer[reg.key[1]]
            entry["DP"][str(reg.key[2])] = max(joint, entry["DP"].get(str(reg.key[2]), 0))
            medium = reg.medium.upper()
            entry[medium] = max(entry.get(medium, 0), joint)
            entry["longest_matched"] = max(entry["longest_matched"], joint)
            entry["attention_matched"] = max(entry["attention_matched"], attention)
        return answer

    def _answer_servers(self, answer: dict[str, dict[str, Any]], q: Query, servers: Sequence[Registration],
                        max_tokens: int) -> None:
        """KV cache servers: the hit of each tier (`CPU`, `DISK`) and `longest_matched` over all of them
        (the server's lookup takes a chunk from whichever tier holds it), from the prompt's chunk ids
        (kv_events/chunk_ids.py, the query's salt folded in), walked chunk by chunk (a tier that bounds
        itself drops a chain's head first: its held chunks need not be a prefix). `/query_by_hash` gets
        none: the ids need the token ids."""
        cid = self.table.context_id(q.model, q.lora_name, b"")
        data = q.token_data if q.token_data is not None else (
            token_bytes(q.token_ids) if q.token_ids is not None else None)
        if cid is None or data is None:
            return
        get = self.table.masks_get(cid)
        memo: dict[int, PromptBlocks] = {}
        for reg in servers:
            for size in {rule.block_size for rule in reg.groups.values()} - memo.keys():
                memo[size] = PromptBlocks([chunk_key(chunk_id(h, q.cache_salt)) for h in chunk_hash_chain(data, size)],
                                          get)
            entry = answer[reg.key[1]]
            rules = {g & 0xFFFF: rule for g, rule in sorted(reg.groups.items())}
            bits = {g: 1 << slot for g, slot in reg.slots.items()}
            for medium in SERVER_MEDIA:
                groups = [(rule, bits.get(server_group(medium, og), 0)) for og, rule in rules.items()]
                if any(bit for _, bit in groups):
                    hit = instance_hit(groups, memo, max_tokens, HeldOrder.ANY)[0]
                    entry[medium] = max(entry.get(medium, 0), hit)
            union = [(rule, sum(bits.get(server_group(medium, og), 0) for medium in SERVER_MEDIA))
                     for og, rule in rules.items()]
            joint, attention = instance_hit(union, memo, max_tokens, HeldOrder.ANY)
            entry["DP"][str(reg.key[2])] = max(joint, entry["DP"].get(str(reg.key[2]), 0))
            entry["longest_matched"] = max(entry["longest_matched"], joint)
            entry["attention_matched"] = max(entry["attention_matched"], attention)

    def _blocks(self, cid: int, q: Query, regs: Sequence[Registration]) -> dict[int, PromptBlocks]:
        """Per block size the registrations' groups use: the prompt's blocks, probed on demand."""
        sizes = {r.block_size for reg in regs for r in reg.groups.values()}
        get = self.table.masks_get(cid)
        out: dict[int, PromptBlocks] = {}
        data = q.token_data if q.token_data is not None else (
            token_bytes(q.token_ids) if q.token_ids is not None else None)
        for size in sorted(sizes):
            if data is not None:
                chunks = list(seq_hash_chunks(data, size))  # (one chunk from the native loop)
                out[size] = PromptBlocks(chunks[0] if len(chunks) == 1 else [h for c in chunks for h in c], get)
            elif size == q.block_size and q.seq_hashes is not None:
                out[size] = PromptBlocks(q.seq_hashes, get)
        return out

    def _max_tokens(self, q: Query) -> int:
        """The longest hit the engine may report: one token short of the prompt."""
        if q.token_data is not None:
            return len(q.token_data) // 4 - 1
        if q.token_ids is not None:
            return len(q.token_ids) - 1
        count = len(q.seq_hashes or ()) * (q.block_size or 0)
        return min(count, q.num_tokens - 1) if q.num_tokens else count
