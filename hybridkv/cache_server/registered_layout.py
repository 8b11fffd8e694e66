"""A registered engine layout: its validation, its object groups and the block rules of
docs/design.md §6 (KV cache server rules).

An object group is the set of engine groups stored as one object per chunk: the full-attention
groups form one, sliding groups one per distinct window (in chunks), chunked-local groups one per
distinct attention chunk, each state group its own; `--no-separate-object-groups` puts every
group into one. Cross-attention groups are never cached and never gate anything.

Per engine group g and chunk j (tokens [s, e), `bpc` = chunk / B_g blocks) two block ranges:

    kept(j)        blocks stored when chunk j completes   full: all  sliding: last ceil((W-1)/B)
                                                          state: last one   chunked: those in the
                                                          attention chunk of token e-1 (none if C | e)
    needed(j, c)   blocks a hit of c chunks (L = c * chunk tokens) reads; always within kept(j):
                   full: all   sliding: tokens [L-W+1, L)   state: the last block of chunk c-1
                   chunked: tokens [floor(L/C)*C, L)

The chunks an object group needs for a hit of c chunks are one contiguous range
`lo(c) .. c-1` (possibly empty), which makes a lookup O(1) per candidate length.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hybridkv.errors import HybridKVError
from hybridkv.wire import ErrorCode, GroupKind, GroupLayout, Layout, ObjectGroupInfo


class RequestError(HybridKVError, ValueError):
    """A request the server rejects; `code` goes into the error reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _bad_layout(message: str) -> RequestError:
    return RequestError(ErrorCode.BAD_LAYOUT, message)


def valid_chunk_sizes(layout: Layout, *, count: int = 4) -> list[int]:
    """The first `count` chunk sizes every cached group's block size divides."""
    step = math.lcm(*[g.block_tokens for g in layout.groups if g.kind is not GroupKind.CROSS] or [1])
    return [step * i for i in range(1, count + 1)]


def layer_pages(g: GroupLayout) -> list[int]:
    """Page bytes of each layer of `g` (its `layer_page_bytes`, or `page_bytes` for every layer)."""
    return list(g.layer_page_bytes) if g.layer_page_bytes is not None else [g.page_bytes] * g.num_layers


def layer_buffers(g: GroupLayout) -> list[int]:
    """Buffer index of each layer of `g` (its `layer_buffers`, or layer j in buffer j)."""
    return list(g.layer_buffers) if g.layer_buffers is not None else list(range(g.num_layers))


def buffer_strides(layout: Layout) -> list[int]:
    """Bytes between blocks in each buffer: its own `page_stride_bytes`, else the layout's."""
    return [buf.page_stride_bytes or layout.page_stride_bytes for buf in layout.buffers]


def validate_layout(layout: Layout, chunk_tokens: int) -> None:
    """Raise RequestError(BAD_LAYOUT) naming what is wrong with `layout` for this server."""
    if not layout.groups:
        raise _bad_layout("a layout needs at least one group, got none")
    if not 0 <= layout.rank < layout.world_size:
        raise _bad_layout(f"rank {layout.rank} must be in [0, world_size={layout.world_size})")
    if layout.num_blocks < 2 or layout.page_stride_bytes <= 0:
        raise _bad_layout(f"num_blocks must be >= 2 and page_stride_bytes > 0, got {layout.num_blocks} "
                          f"and {layout.page_stride_bytes}")
    if not layout.fingerprint:
        raise _bad_layout("the layout fingerprint is empty")
    for i, buf in enumerate(layout.buffers):
        name = buf.shm_name
        if not name or len(name) > 255 or not name.isprintable():
            raise _bad_layout(f"buffer {i}: the segment label must be 1 to 255 printable characters (no NUL or "
                              f"control characters), got {name!r:.100}")
    for i, (buf, stride) in enumerate(zip(layout.buffers, buffer_strides(layout), strict=True)):
        if buf.page_stride_bytes < 0:
            raise _bad_layout(f"buffer {i} ({buf.shm_name!r}): page_stride_bytes must be >= 0 (0: the layout's), "
                              f"got {buf.page_stride_bytes}")
        if not 0 <= buf.offset_bytes < stride:
            raise _bad_layout(f"buffer {i} ({buf.shm_name!r}): offset_bytes must be in [0, page stride {stride}), "
                              f"got {buf.offset_bytes}")
        need = layout.num_blocks * stride
        if buf.size_bytes < need:
            raise _bad_layout(f"buffer {i} ({buf.shm_name!r}) has {buf.size_bytes} bytes, expected at least "
                              f"num_blocks * page_stride_bytes = {need}")
    for gid, g in enumerate(layout.groups):
        _validate_group(gid, g, layout, chunk_tokens)


def _validate_group(gid: int, g: GroupLayout, layout: Layout, chunk_tokens: int) -> None:
    if g.block_tokens <= 0 or g.num_layers <= 0 or g.page_bytes <= 0:
        raise _bad_layout(f"group {gid}: block_tokens, num_layers and page_bytes must be positive, got "
                          f"{g.block_tokens}, {g.num_layers}, {g.page_bytes}")
    if g.layer_page_bytes is not None:
        pages = g.layer_page_bytes
        if len(pages) != g.num_layers or min(pages, default=0) <= 0 or max(pages) != g.page_bytes:
            raise _bad_layout(f"group {gid}: layer_page_bytes must list {g.num_layers} positive page sizes (one "
                              f"per layer) whose largest is page_bytes {g.page_bytes}, got {pages}")
    _validate_group_buffers(gid, g, layout)
    _validate_state_pages(gid, g, layout)
    if g.kind in (GroupKind.SLIDING, GroupKind.CHUNKED) and g.window_tokens <= 0:
        raise _bad_layout(f"group {gid} ({g.kind.value}) needs window_tokens > 0, got {g.window_tokens}")
    if g.kind is not GroupKind.CROSS and chunk_tokens % g.block_tokens:
        raise _bad_layout(
            f"chunk size {chunk_tokens} must be a multiple of group {gid}'s block size {g.block_tokens} "
            f"({g.kind.value}); valid chunk sizes: {valid_chunk_sizes(layout)} ...")


def _validate_state_pages(gid: int, g: GroupLayout, layout: Layout) -> None:
    """The pages of a multi-page state are consecutive state groups of one block size and layer count."""
    if g.state_pages == 1 and g.state_page == 0:
        return
    lead = gid - g.state_page
    same = (g.kind is GroupKind.STATE and 0 <= g.state_page < g.state_pages and lead >= 0
            and lead + g.state_pages <= len(layout.groups))
    if same:
        pages = layout.groups[lead : lead + g.state_pages]
        same = all(p.kind is GroupKind.STATE and p.state_pages == g.state_pages and p.state_page == i
                   and p.block_tokens == g.block_tokens and p.num_layers == g.num_layers for i, p in enumerate(pages))
    if not same:
        raise _bad_layout(f"group {gid}: state page {g.state_page} of {g.state_pages} must be one of "
                          f"{g.state_pages} consecutive state groups numbered 0..{g.state_pages - 1} with one block "
                          f"size and layer count (the multi-page state layout)")


def _validate_group_buffers(gid: int, g: GroupLayout, layout: Layout) -> None:
    """Every layer's page lies inside its buffer's block, and no two layers of the group overlap."""
    if g.layer_buffers is None and g.num_layers > len(layout.buffers):
        raise _bad_layout(f"group {gid} has {g.num_layers} layers but only {len(layout.buffers)} buffers "
                          "are registered (layer j of every group lives in buffer j)")
    buffers = layer_buffers(g)
    if len(buffers) != g.num_layers or not all(0 <= b < len(layout.buffers) for b in buffers):
        raise _bad_layout(f"group {gid}: layer_buffers must give each of its {g.num_layers} layers a buffer index "
                          f"in [0, {len(layout.buffers)}), got {g.layer_buffers}")
    strides = buffer_strides(layout)
    spans: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # (segment, stride) -> (start, end, layer)
    for layer, (page, b) in enumerate(zip(layer_pages(g), buffers, strict=True)):
        buf = layout.buffers[b]
        if buf.offset_bytes + page > strides[b]:
            at = f" at offset {buf.offset_bytes}" if buf.offset_bytes else ""
            raise _bad_layout(f"group {gid}: layer {layer}'s page of {page} bytes{at} exceeds the page stride "
                              f"{strides[b]} of buffer {b}")
        spans.setdefault((buf.shm_name, strides[b]), []).append((buf.offset_bytes, buf.offset_bytes + page, layer))
    for (name, _), found in spans.items():
        found.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(found):
            if start < end:
                raise _bad_layout(f"group {gid}: layers {first} and {second} overlap in buffer {name!r} (a page ends "
                                  f"at {end}, the next starts at {start})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectGroup:
    index: int
    name: str
    groups: tuple[int, ...]  # engine group indices, in layout order


def object_groups(layout: Layout, chunk_tokens: int, *, separate: bool) -> list[ObjectGroup]:
    """The object groups of a (validated) layout, in a deterministic order."""
    cached = [(gid, g) for gid, g in enumerate(layout.groups) if g.kind is not GroupKind.CROSS]
    if not separate:
        return [ObjectGroup(index=0, name="all", groups=tuple(gid for gid, _ in cached))] if cached else []
    names: dict[str, list[int]] = {}
    for gid, g in cached:
        names.setdefault(_object_group_name(gid, g, chunk_tokens), []).append(gid)
    return [ObjectGroup(index=i, name=name, groups=tuple(gids)) for i, (name, gids) in enumerate(names.items())]


def _object_group_name(gid: int, g: GroupLayout, chunk_tokens: int) -> str:
    if g.kind is GroupKind.FULL:
        return "full"
    if g.kind is GroupKind.SLIDING:
        return f"window:{math.ceil((g.window_tokens - 1) / chunk_tokens)}"
    if g.kind is GroupKind.CHUNKED:
        return f"chunked:{g.window_tokens}"
    return f"state:g{gid - g.state_page}"  # every page of a multi-page state: one object group


def object_group_infos(groups: list[ObjectGroup]) -> list[ObjectGroupInfo]:
    return [ObjectGroupInfo(name=og.name, groups=list(og.groups)) for og in groups]


class ChunkRules:
    """The kept / needed block ranges of one layout at one chunk size (see the module doc)."""

    def __init__(self, layout: Layout, chunk_tokens: int) -> None:
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = [chunk_tokens // g.block_tokens if g.kind is not GroupKind.CROSS else 0
                                 for g in layout.groups]
        self._pages = [layer_pages(g) for g in layout.groups]
        self._buffers = [layer_buffers(g) for g in layout.groups]
        self._object_bytes: dict[tuple[int, int], int] = {}  # (object group, chunk) -> bytes

    def kept(self, gid: int, chunk: int) -> range:
        g, bpc = self.layout.groups[gid], self.blocks_per_chunk[gid]
        if g.kind is GroupKind.FULL:
            return range(bpc)
        if g.kind is GroupKind.SLIDING:
            return range(bpc - min(bpc, math.ceil((g.window_tokens - 1) / g.block_tokens)), bpc)
        if g.kind is GroupKind.STATE:
            return range(bpc - 1, bpc)
        if g.kind is GroupKind.CHUNKED:
            start, end = chunk * self.chunk_tokens, (chunk + 1) * self.chunk_tokens
            if end % g.window_tokens == 0:
                return range(bpc, bpc)
            first = max(start, (end - 1) // g.window_tokens * g.window_tokens)
            return range((first - start) // g.block_tokens, bpc)
        return range(0)

    def needed(self, gid: int, chunk: int, hit_chunks: int) -> range:
        """Blocks of chunk `chunk` (< hit_chunks) that a hit of `hit_chunks` chunks reads."""
        g, bpc = self.layout.groups[gid], self.blocks_per_chunk[gid]
        hit, start = hit_chunks * self.chunk_tokens, chunk * self.chunk_tokens
        if g.kind is GroupKind.FULL:
            return range(bpc)
        if g.kind is GroupKind.STATE:
            return range(bpc - 1, bpc) if chunk == hit_chunks - 1 else range(0)
        if g.kind is GroupKind.SLIDING:
            first_token = hit - g.window_tokens + 1
        elif g.kind is GroupKind.CHUNKED:
            first_token = hit // g.window_tokens * g.window_tokens
        else:
            return range(0)
        if first_token >= start + self.chunk_tokens:
            return range(0)
        return range(max(0, first_token - start) // g.block_tokens, bpc)

    def first_needed_chunk(self, gid: int, hit_chunks: int) -> int:
        """`lo`: the first chunk group `gid` needs for a hit of `hit_chunks` (= hit_chunks if none)."""
        g, hit = self.layout.groups[gid], hit_chunks * self.chunk_tokens
        if hit_chunks == 0 or g.kind is GroupKind.CROSS:
            return hit_chunks
        if g.kind is GroupKind.FULL:
            return 0
        if g.kind is GroupKind.STATE:
            return hit_chunks - 1
        if g.kind is GroupKind.SLIDING:
            first_token = max(0, hit - g.window_tokens + 1)
        else:
            if hit % g.window_tokens == 0:
                return hit_chunks
            first_token = hit // g.window_tokens * g.window_tokens
        return min(hit_chunks, first_token // self.chunk_tokens)

    def object_bytes(self, og: ObjectGroup, chunk: int) -> int:
        nbytes = self._object_bytes.get((og.index, chunk))
        if nbytes is None:
            nbytes = sum(len(self.kept(gid, chunk)) * self.section_block_bytes(gid) for gid in og.groups)
            if len(self._object_bytes) < 1 << 16:  # chunk indices are bounded by context lengths
                self._object_bytes[(og.index, chunk)] = nbytes
        return nbytes

    def section_block_bytes(self, gid: int) -> int:
        """Bytes of one block of group gid in an object: each of its layers' pages."""
        return sum(self._pages[gid])

    def layer_pages(self, gid: int) -> list[int]:
        """Page bytes of each layer of group gid, in object order (layer 0 first)."""
        return self._pages[gid]

    def layer_copies(self, gid: int) -> list[tuple[int, int]]:
        """(buffer index, page bytes) of each layer of group gid, in object order."""
        return list(zip(self._buffers[gid], self._pages[gid], strict=True))

    def block_offset(self, og: ObjectGroup, chunk: int, gid: int, block: int) -> int:
        """Byte offset in the object of (og, chunk) of group gid's block `block` (in kept(gid, chunk)).

        Object bytes: for each member group in order, for each kept block in order, each layer's page.
        """
        offset = 0
        for member in og.groups:
            kept = self.kept(member, chunk)
            if member == gid:
                return offset + (block - kept.start) * self.section_block_bytes(gid)
            offset += len(kept) * self.section_block_bytes(member)
        raise KeyError(f"group {gid} is not in object group {og.name}")


class TreeRules:
    """The hit rules of one registered layout and cache salt, per object group (prefix_index.PrefixRules)."""

    def __init__(self, tree_id: bytes, rules: ChunkRules, groups: list[ObjectGroup], salt: str = "") -> None:
        self.tree_id = tree_id
        self.salt = salt  # (the KV events fold it into the chunk ids they publish: tier_events.py)
        self.num_object_groups = len(groups)
        kinds = [{rules.layout.groups[gid].kind for gid in og.groups} for og in groups]
        self.state_object_groups = frozenset(og.index for og, k in zip(groups, kinds, strict=True)
                                             if GroupKind.STATE in k)
        self.full_object_groups = frozenset(og.index for og, k in zip(groups, kinds, strict=True)
                                            if GroupKind.FULL in k)
        self._rules = rules
        self._groups = groups

    def first_needed(self, object_group: int, hit_chunks: int) -> int:
        return min(self._rules.first_needed_chunk(gid, hit_chunks) for gid in self._groups[object_group].groups)

    def empty(self, object_group: int, chunk: int) -> bool:
        return self._rules.object_bytes(self._groups[object_group], chunk) == 0

    def event_kind(self, object_group: int) -> tuple[str, int | None] | None:
        """The object group's hit rule as vLLM's `kv_cache_spec_kind` and window (the most demanding of
        its members': full, then chunked, then sliding, then state); None: it gates no hit (cross)."""
        members = [self._rules.layout.groups[gid] for gid in self._groups[object_group].groups]
        kinds = {g.kind for g in members}
        if GroupKind.FULL in kinds:
            return "full_attention", None
        if GroupKind.CHUNKED in kinds:
            return "chunked_local_attention", None
        if GroupKind.SLIDING in kinds:
            return "sliding_window", max(g.window_tokens for g in members if g.kind is GroupKind.SLIDING)
        return ("mamba", None) if GroupKind.STATE in kinds else None
