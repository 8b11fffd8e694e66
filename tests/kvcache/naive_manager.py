"""A naive reference for prefix hits: plain sets of token prefixes, no blocks, no eviction.

It *defines* the hit the real manager must find:

    cached[g]  = every block-aligned prefix (salt, tokens[:end]) whose block group g computed
                 (attention: every full block a step completed; Mamba ALIGN: the block boundary a
                 step ended on; Mamba ALL: every block boundary a step crossed or ended on)
    serve(g,L) = full:     prefixes of every block end <= L are cached
                 sliding:  the ceil((W-1)/B) blocks before L (or all of them, from 0) are cached
                 chunked:  the blocks from the start of L's chunk to L are cached
                 mamba:    L == 0 or the prefix of length L is cached
    hit        = the largest L <= num_tokens - 1, a multiple of every block size, that every
                 group can serve   (brute force, L descending)

Since nothing is ever evicted here, the real manager's hit is never longer; with a pool large
enough to never evict, the two are equal.

`ContentTracker` records which tokens every block id holds (from the block ids the real manager
hands out, and the block copies it asks for) and checks that a hit never uses a block whose content
differs from the request's. With `RunningState.FIXED` a state table holds one real entry, the last:
the running state, read and written by every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.plan.planner import KVCacheGroupSpec, RunningState
from hybridkv.plan.specs import MambaCacheMode, SpecKind

Prefix = tuple[str | None, tuple[int, ...]]


def first_required_block(group: KVCacheGroupSpec, length: int) -> int | None:
    """First block a group needs cached to serve a hit of `length` tokens (None: cannot hit).
    Every block from there up to `length` is needed."""
    size = group.block_size
    if length == 0:
        return 0
    if group.kind is SpecKind.FULL:
        return 0
    if group.kind is SpecKind.SLIDING_WINDOW:
        return max(0, length // size - math.ceil((group.window_tokens - 1) / size))
    if group.kind is SpecKind.CHUNKED_LOCAL:
        return length // group.chunk_tokens * group.chunk_tokens // size
    if group.kind is SpecKind.MAMBA:
        return length // size - 1
    return None


class NaiveManager:
    """Sets of cached prefixes per group; see the module docstring."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec], mamba_mode: MambaCacheMode = MambaCacheMode.ALIGN) -> None:
        self.groups = list(groups)
        self.mamba_mode = mamba_mode
        self.cached: list[set[Prefix]] = [set() for _ in self.groups]
        self.step = math.lcm(*(g.block_size for g in self.groups))

    def record_step(self, tokens: Sequence[int], salt: str | None, start: int, end: int) -> None:
        """A request computed tokens [start, end) (start = its computed tokens incl. hits)."""
        for g, group in enumerate(self.groups):
            size = group.block_size
            if group.kind is SpecKind.CROSS or end <= start:
                continue
            if group.kind is SpecKind.MAMBA:
                for boundary in state_writes(size, start, end, self.mamba_mode):
                    if boundary % size == 0:
                        self.cached[g].add((salt, tuple(tokens[:boundary])))
                continue
            for index in range(start // size, end // size):
                self.cached[g].add((salt, tuple(tokens[: (index + 1) * size])))

    def reset(self) -> None:
        for cached in self.cached:
            cached.clear()

    def can_serve(self, g: int, tokens: Sequence[int], salt: str | None, length: int) -> bool:
        first = first_required_block(self.groups[g], length)
        if first is None:
            return False
        size = self.groups[g].block_size
        cached = self.cached[g]
        return all((salt, tuple(tokens[: (i + 1) * size])) in cached for i in range(first, length // size))

    def longest_hit(self, tokens: Sequence[int], salt: str | None) -> int:
        top = (len(tokens) - 1) // self.step * self.step
        for length in range(top, -1, -self.step):
            if all(self.can_serve(g, tokens, salt, length) for g in range(len(self.groups))):
                return length
        return 0


def state_writes(size: int, start: int, end: int, mode: MambaCacheMode) -> list[int]:
    """Token counts after which a step [start, end) stores the state (docs/design.md §4):
    ALIGN only at its end; ALL also at every block boundary it crosses."""
    if end <= start:
        return []
    if mode is MambaCacheMode.ALIGN:
        return [end]
    points = [t for t in range(start + 1, end + 1) if t % size == 0]
    return points if points and points[-1] == end else [*points, end]


def required_entries(group: KVCacheGroupSpec, first_new: int, total: int,
                     mamba_mode: MambaCacheMode = MambaCacheMode.ALIGN,
                     running: RunningState = RunningState.MOVING) -> set[int] | None:
    """Table entries that must be real blocks for a step computing from token `first_new` with
    slots up to `total`, from the attention definitions (docs/design.md §4), not the manager's
    keep rule; every other entry must be the null block. None: every entry is required (full).

        sliding W: the step's first token attends to tokens first_new - W + 1 .. first_new
        chunked C: a token attends to its own chunk, which starts at first_new // C * C
        mamba:     the state after first_new tokens (read) and the states being written
                   (ALIGN: the last entry; ALL: every entry after the read one)
    """
    size = group.block_size
    num_entries = -(-total // size)
    if group.kind is SpecKind.FULL:
        return None
    if group.kind is SpecKind.SLIDING_WINDOW:
        first_token = max(0, first_new - group.window_tokens + 1)
        return {i for i in range(num_entries) if (i + 1) * size > first_token}
    if group.kind is SpecKind.CHUNKED_LOCAL:
        chunk_start = first_new // group.chunk_tokens * group.chunk_tokens
        return {i for i in range(num_entries) if (i + 1) * size > chunk_start}
    if group.kind is SpecKind.MAMBA:
        real = {num_entries - 1}
        if running is RunningState.FIXED:  # the running state: read and written in place
            return real
        if mamba_mode is MambaCacheMode.ALL:
            real |= set(range(max(0, -(-first_new // size) - 1), num_entries))
        if first_new:
            real.add(-(-first_new // size) - 1)
        return real
    raise AssertionError(f"no table rule for {group.kind}")


class ContentTracker:
    """What each block id physically holds: what the last *completed* step wrote into it.

    Attention: entry i of group g receives the KV of the step's tokens in [i*B, (i+1)*B); the
    tracker keeps, per block, the group, the position and the token prefix written so far (with
    the salt). Mamba: the last entry of a table receives the state after the step's last token.
    A step that was allocated but never ran writes nothing. A hit (or a running table) is sound
    only if every real block it uses holds exactly the request's own prefix at that position.
    """

    def __init__(self, groups: Sequence[KVCacheGroupSpec], mamba_mode: MambaCacheMode = MambaCacheMode.ALIGN,
                 running: RunningState = RunningState.MOVING) -> None:
        self.groups = list(groups)
        self.mamba_mode = mamba_mode
        self.running = running
        self.attention: dict[int, tuple[int, int, tuple[int, ...], str | None]] = {}
        self.state: dict[int, tuple[int, Prefix]] = {}

    def record_step(self, tokens: Sequence[int], salt: str | None, tables: Sequence[Sequence[int]],
                    start: int, end: int) -> None:
        """A step computed tokens [start, end) into `tables` (the request's tables after allocate)."""
        for g, table in enumerate(tables):
            group = self.groups[g]
            size = group.block_size
            if group.kind is SpecKind.MAMBA:
                for point in state_writes(size, start, end, self.mamba_mode):
                    self.state[table[-(-point // size) - 1]] = (g, (salt, tuple(tokens[:point])))
                continue
            for i in range(start // size, -(-end // size)):
                if table[i]:
                    self.attention[table[i]] = (g, i, tuple(tokens[: min(end, (i + 1) * size)]), salt)

    def hit_problems(self, tokens: Sequence[int], salt: str | None, length: int,
                     blocks: Sequence[Sequence[int]]) -> list[str]:
        """Why a hit of `length` tokens on `blocks` is unsound (empty: sound)."""
        problems = []
        for g, entries in enumerate(blocks):
            group = self.groups[g]
            size = group.block_size
            if len(entries) != length // size:
                problems.append(f"group {g}: {len(entries)} entries for a hit of {length}")
                continue
            needed = required_entries(group, length, length)
            if group.kind is SpecKind.MAMBA:
                needed = {length // size - 1} if length else set()
            for i in range(len(entries)):
                if (needed is None or i in needed) and not entries[i]:
                    problems.append(f"group {g} ({group.kind.value}): hit of {length} lacks a block at {i}")
                elif entries[i]:
                    problems += self._block_problems(g, i, entries[i], tokens, salt, (i + 1) * size)
        return problems

    def check_hit(self, tokens: Sequence[int], salt: str | None, length: int, blocks: Sequence[Sequence[int]]) -> None:
        problems = self.hit_problems(tokens, salt, length, blocks)
        assert not problems, problems

    def check_table(self, tokens: Sequence[int], salt: str | None, tables: Sequence[Sequence[int]],
                    first_new: int, total: int) -> None:
        """Right after `allocate`: the entries the step needs are real and hold the request's
        own earlier tokens; the entries it does not need are null (released early)."""
        for g, table in enumerate(tables):
            group = self.groups[g]
            size = group.block_size
            assert len(table) == -(-total // size), f"group {g}: {len(table)} entries for {total} slots"
            needed = required_entries(group, first_new, total, self.mamba_mode, self.running)
            for i, block_id in enumerate(table):
                if needed is not None and i not in needed:
                    assert not block_id, f"group {g} ({group.kind.value}): entry {i} should be released at {first_new}"
                    continue
                assert block_id, f"group {g} ({group.kind.value}): entry {i} is needed at {first_new} but null"
                if group.kind is SpecKind.MAMBA:
                    read_entry = len(table) - 1 if self.running is RunningState.FIXED else -(-first_new // size) - 1
                    if first_new and i == read_entry:
                        problems = self._block_problems(g, i, block_id, tokens, salt, first_new)
                        assert not problems, problems
                elif i * size < first_new:
                    problems = self._block_problems(g, i, block_id, tokens, salt, min(first_new, (i + 1) * size))
                    assert not problems, problems

    def check_state_steps(self, steps: Sequence[object], tables: Sequence[Sequence[int]], first_new: int,
                          end: int) -> None:
        """`KVCacheManager.state_steps` against the definition: entry ceil(t/B) - 1 holds the state
        after t tokens; a step reads the state after `first_new` and writes `state_writes`."""
        expected = []
        for g, group in enumerate(self.groups):
            if group.kind is not SpecKind.MAMBA:
                continue
            size, table = group.block_size, tables[g]
            read_entry = len(table) - 1 if self.running is RunningState.FIXED else -(-first_new // size) - 1
            read = (first_new, table[read_entry]) if first_new else None
            writes = [(t, table[-(-t // size) - 1]) for t in state_writes(size, first_new, end, self.mamba_mode)]
            expected.append((g, read, writes))
        got = []
        for step in steps:
            read = None if step.read is None else (step.read.num_tokens, step.read.block_id)  # type: ignore[attr-defined]
            got.append((step.group_id, read, [(w.num_tokens, w.block_id) for w in step.writes]))  # type: ignore[attr-defined]
        assert got == expected, f"state_steps [{first_new}, {end}): {got} != {expected}"

    def apply_copies(self, copies: Sequence[object]) -> None:
        """The engine ran `copies` (`BlockCopy`s, in order): each block now holds its source's content."""
        for copy in copies:
            src, dst = copy.src_block_id, copy.dst_block_id  # type: ignore[attr-defined]
            for held in (self.state, self.attention):
                if src in held:
                    held[dst] = held[src]  # type: ignore[assignment]
                else:
                    held.pop(dst, None)

    def _block_problems(self, g: int, i: int, block_id: int, tokens: Sequence[int], salt: str | None,
                        end: int) -> list[str]:
        """Whether block `block_id` at entry i of group g holds the request's first `end` tokens."""
        if self.groups[g].kind is SpecKind.MAMBA:
            if self.state.get(block_id) != (g, (salt, tuple(tokens[:end]))):
                return [f"group {g} entry {i}: block {block_id} does not hold the state after {end} tokens"]
            return []
        held = self.attention.get(block_id)
        if held is None:
            return [f"group {g} entry {i}: block {block_id} was never written"]
        owner_group, position, written, owner_salt = held
        if (owner_group, position, owner_salt) != (g, i, salt):
            return [f"block {block_id} holds group {owner_group} position {position}, used as group {g} position {i}"]
        if len(written) < end or list(written[:end]) != list(tokens[:end]):
            return [f"group {g} entry {i}: block {block_id} holds {len(written)} written tokens, "
                    f"not the request's first {end}"]
        return []
