"""The index proper: for every block prefix of every context, which (registration, group) holds it.

    context   = (model, LoRA, cache-salt namespace)   blocks of different contexts never match
    block key = the rolling sequence hash of the prefix (seq_hash.py), per block size
    masks     = {block key: bit mask of slots}         one slot per (registration, KV cache group)
    engine    = per registration, {engine block hash: (context id << 64) | block key}

A `BlockStored` event is placed by its parent: the root of a chain (no parent) opens the context
of its salt; a later block continues its parent's context and chain. A block whose parent the
index does not know (lost events, a chain begun before the subscription) cannot be placed and is
counted, never guessed. Salts are kept only as keyed digests (`Namespaces`): the index never
holds or shows one in the clear, and a query without the salt cannot reach salted blocks.

Memory: one `masks` entry per distinct (context, block key) and one `engine` entry per block a
registration holds (bench_routing.py measures bytes per indexed block).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridkv.index.rules import GroupRule, RuleKind, rule_kind
from hybridkv.index.seq_hash import iter_seq_hashes, token_bytes
from hybridkv.kv_events.chunk_ids import MEDIUM_CPU, MEDIUM_DISK, SERVER_TYPE, chunk_key
from hybridkv.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = ["SERVER_MEDIA", "SERVER_TYPE", "IngestCounts", "Namespaces", "PrefixTable", "RegKey", "Registration",
           "group_rule", "server_group"]

_SEQ_BITS = 64
_SEQ_MASK = (1 << _SEQ_BITS) - 1
RegKey = tuple[str, str, int]  # (tenant, instance id, dp rank)
SERVER_MEDIA = (MEDIUM_CPU, MEDIUM_DISK)  # a server registration's group key: medium index << 16 | object group


def group_rule(spec_kind: str | None, block_size: int, window_tokens: int | None) -> GroupRule:
    """A group's rule from vLLM's event fields (a window-less sliding group reads as never hit)."""
    kind = rule_kind(spec_kind)
    if kind is RuleKind.SLIDING and not window_tokens:
        kind = RuleKind.NEVER
    return GroupRule(kind=kind, block_size=max(1, block_size), window_tokens=window_tokens or 0)


def server_group(medium: str | None, object_group: int) -> int:
    """A server registration's group key for an object group of one medium (tier)."""
    medium = (medium or MEDIUM_CPU).upper()
    return (SERVER_MEDIA.index(medium) if medium in SERVER_MEDIA else 0) << 16 | object_group


class Namespaces:
    """Cache salts as keyed digests: equal salts give equal ids inside this process, nothing else."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def of(self, salt: str | None) -> bytes:
        if not salt:
            return b""
        return hashlib.blake2b(salt.encode(), key=self._key, digest_size=16).digest()


@dataclass(slots=True)
class IngestCounts:
    """What ingestion did (exported on /metrics)."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    unplaced_blocks: int = 0  # parent unknown
    skipped_blocks: int = 0  # multimodal extra keys, or over the block budget
    unknown_removals: int = 0


@dataclass(slots=True)
class Registration:
    """One registered publisher (one engine instance, one DP rank) and what it holds."""

    key: RegKey
    model: str
    lora_name: str | None
    block_size: int
    kind: str = "vLLM"
    medium: str = "GPU"
    groups: dict[int, GroupRule] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)  # group idx -> slot
    slot_mask: int = 0
    engine: dict[Any, int] = field(default_factory=dict)
    copies: dict[tuple[int, Any], int] = field(default_factory=dict)  # (group, engine hash): extra copies
    blocks: int = 0


@dataclass(slots=True)
class _Context:
    masks: dict[int, int] = field(default_factory=dict)


class PrefixTable:
    """Ingests event batches per registration; answers which blocks of a prompt each group holds."""

    def __init__(self, *, max_blocks: int = 4_000_000, namespaces: Namespaces | None = None) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self.namespaces = namespaces or Namespaces()
        self.counts = IngestCounts()
        self.registrations: dict[RegKey, Registration] = {}
        self._contexts: list[_Context] = []
        self._context_ids: dict[tuple[str, str | None, bytes], int] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.num_blocks = 0  # (slot, block) entries over all registrations

    # -- registrations ----------------------------------------------------------------------------

    def add(self, reg: Registration) -> None:
        if reg.key in self.registrations:
            self.drop(reg.key)
        self.registrations[reg.key] = reg

    def drop(self, key: RegKey) -> Registration | None:
        """Forget a registration and every block it held."""
        reg = self.registrations.pop(key, None)
        if reg is not None:
            self.clear(reg)
            for slot in reg.slots.values():
                self._free_slots.append(slot)
            reg.slots.clear()
            reg.slot_mask = 0
        return reg

    def clear(self, reg: Registration) -> None:
        """Drop every block `reg` holds (AllBlocksCleared, a sequence gap, ageing)."""
        contexts = self._contexts
        keep = ~reg.slot_mask
        for packed in reg.engine.values():
            masks = contexts[packed >> _SEQ_BITS].masks
            seq = packed & _SEQ_MASK
            mask = masks.get(seq, 0) & keep
            if mask:
                masks[seq] = mask
            else:
                masks.pop(seq, None)
        self.num_blocks -= reg.blocks
        reg.blocks = 0
        reg.engine.clear()
        reg.copies.clear()

    def _slot(self, reg: Registration, group_idx: int) -> int:
        slot = reg.slots.get(group_idx)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            reg.slots[group_idx] = slot
            reg.slot_mask |= 1 << slot
        return slot

    def context_id(self, model: str, lora_name: str | None, namespace: bytes) -> int | None:
        return self._context_ids.get((model, lora_name or None, namespace))

    def _context(self, model: str, lora_name: str | None, namespace: bytes) -> int:
        key = (model, lora_name or None, namespace)
        cid = self._context_ids.get(key)
        if cid is None:
            cid = self._context_ids[key] = len(self._contexts)
            self._contexts.append(_Context())
        return cid

    # -- ingestion --------------------------------------------------------------------------------

    def apply(self, key: RegKey, batch: EventBatch) -> None:
        """Apply one batch of `key`'s publisher (unknown registrations are ignored).

        A stored run whose parent is stored later in the same batch (an engine lists its groups in
        any order: a state group's checkpoint may come before the attention group's blocks) is
        placed once the rest of the batch has been applied."""
        reg = self.registrations.get(key)
        if reg is None:
            return
        waiting: list[BlockStored] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                if not self._store(reg, event, final=False):
                    waiting.append(event)
            elif isinstance(event, BlockRemoved):
                self._remove(reg, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear(reg)
                waiting.clear()
        while waiting:
            left = [e for e in waiting if not self._store(reg, e, final=False)]
            if len(left) == len(waiting):
                for event in left:
                    self._store(reg, event, final=True)
                return
            waiting = left

    def _root_context(self, reg: Registration, event: BlockStored) -> int | None:
        keys = event.extra_keys[0] if event.extra_keys else None
        salt: str | None = None
        if keys:
            strings = [k for k in keys if isinstance(k, str) and k != event.lora_name]
            if len(strings) != len(keys) or len(strings) > 1:  # (multimodal items: not indexable by tokens)
                return None
            salt = strings[0] if strings else None
        return self._context(reg.model, event.lora_name or reg.lora_name, self.namespaces.of(salt))

    def _store(self, reg: Registration, event: BlockStored, *, final: bool) -> bool:
        """Index the event's blocks; False (nothing done) when its parent is unknown and not `final`.

        vLLM skips null blocks: a sliding-window group's blocks out of the window, a state group's
        blocks between checkpoints. Such a sparse event lists fewer hashes than its tokens make
        blocks; each hash is placed where another group's event put the same engine hash (vLLM
        hashes a position alike in every group), so a sparse event waits for the rest of its batch;
        what is still unknown then is taken as the range's last blocks (where a window's tail and
        the checkpoint at a computed chunk's end are)."""
        if reg.kind == SERVER_TYPE:
            return self._store_chunks(reg, event)
        num = len(event.block_hashes)
        group_idx = event.group_idx or 0
        if group_idx not in reg.groups:
            reg.groups[group_idx] = group_rule(event.kv_cache_spec_kind, event.block_size,
                                               event.kv_cache_spec_sliding_window)
        if event.medium:
            reg.medium = event.medium
        if not num:  # (a layout announcement: the group alone)
            return True
        span, rest = divmod(len(event.token_ids), event.block_size)
        if span > num and not rest:
            known = [(h, p) for h in event.block_hashes if (p := reg.engine.get(h)) is not None]
            if len(known) == num:
                return self._mark(reg, group_idx, known)
            if not final:
                return False
        parent = event.parent_block_hash
        if parent is None:
            cid = self._root_context(reg, event)
            seq: int | None = None
        else:
            packed = reg.engine.get(parent)
            if packed is None and not final:
                return False
            cid = None if packed is None else packed >> _SEQ_BITS
            seq = None if packed is None else packed & _SEQ_MASK
        extra = event.extra_keys
        if cid is None or rest or span < num or (extra and any(extra[1:])):
            self.counts.unplaced_blocks += num
            return True
        high = cid << _SEQ_BITS
        seqs = list(iter_seq_hashes(token_bytes(event.token_ids), event.block_size, seq))[span - num:]
        return self._mark(reg, group_idx, [(h, high | s) for h, s in zip(event.block_hashes, seqs, strict=True)])

    def _store_chunks(self, reg: Registration, event: BlockStored) -> bool:
        """A KV cache server's objects: each hash a chunk id (kv_events/chunk_ids.py), placed by itself
        (the salt is folded into the id: one namespace), in the group of its object group and medium."""
        group = server_group(event.medium, event.group_idx or 0)
        if group not in reg.groups:
            reg.groups[group] = group_rule(event.kv_cache_spec_kind, event.block_size,
                                           event.kv_cache_spec_sliding_window)
        ids = [h for h in event.block_hashes if isinstance(h, bytes) and len(h) >= 8]
        self.counts.unplaced_blocks += len(event.block_hashes) - len(ids)
        if not ids:
            return True
        high = self._context(reg.model, event.lora_name or reg.lora_name, b"") << _SEQ_BITS
        return self._mark(reg, group, [(h, high | chunk_key(h)) for h in ids])

    def _mark(self, reg: Registration, group_idx: int, placed: list[tuple[Any, int]]) -> bool:
        """Set the group's bit on each (engine hash, packed context and block key)."""
        num = len(placed)
        if self.num_blocks + num > self.max_blocks:
            self.counts.skipped_blocks += num
            return True
        bit = 1 << self._slot(reg, group_idx)
        contexts = self._contexts
        engine = reg.engine
        added = 0
        for engine_hash, packed in placed:
            masks = contexts[packed >> _SEQ_BITS].masks
            h = packed & _SEQ_MASK
            mask = masks.get(h, 0)
            if not mask & bit:
                masks[h] = mask | bit
                added += 1
            else:  # a second block of the same content (engines may cache a copy): one more removal to come
                copy = (group_idx, engine_hash)
                reg.copies[copy] = reg.copies.get(copy, 0) + 1
            engine[engine_hash] = packed
        reg.blocks += added
        self.num_blocks += added
        self.counts.stored_blocks += num
        return True

    def _remove(self, reg: Registration, event: BlockRemoved) -> None:
        group = server_group(event.medium, event.group_idx or 0) if reg.kind == SERVER_TYPE else event.group_idx or 0
        slot = reg.slots.get(group)
        if slot is None:
            self.counts.unknown_removals += len(event.block_hashes)
            return
        bit = 1 << slot
        others = reg.slot_mask & ~bit
        engine = reg.engine
        contexts = self._contexts
        for engine_hash in event.block_hashes:
            packed = engine.get(engine_hash)
            if packed is None:
                self.counts.unknown_removals += 1
                continue
            masks = contexts[packed >> _SEQ_BITS].masks
            seq = packed & _SEQ_MASK
            mask = masks.get(seq, 0)
            if not mask & bit:
                self.counts.unknown_removals += 1
                continue
            copies = reg.copies.get((group, engine_hash))
            if copies:  # (another copy of the block stays cached)
                if copies == 1:
                    del reg.copies[(group, engine_hash)]
                else:
                    reg.copies[(group, engine_hash)] = copies - 1
                continue
            mask &= ~bit
            if mask:
                masks[seq] = mask
            else:
                del masks[seq]
            if not mask & others:
                del engine[engine_hash]
            reg.blocks -= 1
            self.num_blocks -= 1
            self.counts.removed_blocks += 1

    # -- queries ----------------------------------------------------------------------------------

    def masks_get(self, cid: int) -> Callable[[int, int], int]:
        """Context `cid`'s probe: (block key, default) -> the slot bits that hold the block."""
        return self._contexts[cid].masks.get
