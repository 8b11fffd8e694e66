"""Paged attention over block tables: full, sliding window, chunked local, sinks, KV sharing.

A step's scheduled tokens are flattened into one sequence of T tokens: first every request that
schedules a single token (decodes), then each prefill chunk. For every KV cache group the runner
builds one `GroupMetadata`; every attention layer of that group reuses it:

    write:  cache[write_blocks[t], :, write_offsets[t]] = (k[t], v[t])      for t in 0..T-1
    read:   calls, each = `rows` rows of `queries` consecutive tokens; row r reads whole blocks
            read_block_ids[r, 0..B) and attends to key slot j (offset j % block_size of block
            j // block_size) under mask[r, 0, q, j]

Writes go through a flat view of the cache, [num_blocks * 2 * block_size, kv_heads * head_dim], with
row indices from `flat_rows` (index_copy_ / index_select beat advanced indexing by ~3x on CPU). Reads
gather whole blocks (one index_select per K and V: a block's K is one contiguous run of
block_size * kv_heads * head_dim values) into [rows, keys, kv_heads, head_dim], which SDPA reads
transposed without a copy; per-row gathers cost ~2x as much on a 700-key decode. A row's first and
last block may hold keys it does not see; the mask leaves them out.
Decode calls (one query per row, float32) skip the gather: the native kernel `paged_decode`
(hybridkv/engine/kernels) reads each row's key slots [key_lo, key_hi) in place, ~4x faster than
gather + SDPA on the benchmark's 700-key decodes; without a C compiler they take the gather path.
A call whose rows attend causally to exactly their own new tokens (a prompt's first chunk in a full
attention group, or one shorter than the window) reads the step's new K/V directly, with no gather
and no mask (SDPA's causal kernel skips the masked half).

    tokens  | d0 | d1 | d2 | p0 p0 p0 p0 p0 p0 | p1 p1 p1 p1 |
    calls   |  rows=3, q=1  | rows=2, q=3 (tiles)| rows=1, q=4 |

Rows of one call are padded to its longest; consecutive rows whose key counts grow by more than
a quarter (and 64 keys) start a new call, so decodes ordered by length (the runner's order) are
not all padded to the longest one.

Which keys a query at position p may see (the rule the mask encodes):
full: k <= p; sliding window W: p - W < k <= p; chunked local C: k <= p and k // C == p // C.
Long prefill chunks of sliding/chunked groups are cut into tiles of `tile_tokens` queries so each
tile gathers only the keys its window can reach, not the whole prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hybridkv.engine import kernels
from hybridkv.engine.kernels import paged_decode
from hybridkv.plan.specs import SpecKind


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionRule:
    """Which earlier positions a query sees in one KV cache group."""

    kind: SpecKind
    window_tokens: int = 0
    chunk_tokens: int = 0

    def first_key(self, query_pos: int) -> int:
        """Smallest key position a query at `query_pos` attends to."""
        if self.kind is SpecKind.SLIDING_WINDOW:
            return max(0, query_pos - self.window_tokens + 1)
        if self.kind is SpecKind.CHUNKED_LOCAL:
            return (query_pos // self.chunk_tokens) * self.chunk_tokens
        return 0

    @property
    def untiled_tokens(self) -> int:
        """Longest prefill chunk attended as one causal row (SDPA's causal kernel, no mask)."""
        return 2 * (max(self.window_tokens, 16) if self.kind is SpecKind.SLIDING_WINDOW else self.tile_tokens)

    @property
    def tile_tokens(self) -> int:
        """Query tile for long prefills (0: do not tile, every key is needed anyway).

        A sliding-window tile of Q queries reads Q + W - 1 keys, so every query pays for about
        (Q + W) / W times the keys it sees: a quarter window (1.25x) rather than a whole one (2x);
        with W = 128, SDPA over a 2048-token prompt took 7.4 ms of CPU instead of 10.1 ms."""
        if self.kind is SpecKind.SLIDING_WINDOW:
            return max(self.window_tokens // 4, 16)
        if self.kind is SpecKind.CHUNKED_LOCAL:
            return max(math.gcd(self.chunk_tokens, 256), 16)
        return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCall:
    """`rows` rows of `queries` consecutive flattened tokens starting at `token_start`.

    Each row reads whole blocks: key slot j of a row is offset j % block_size of block
    `read_block_ids[r, j // block_size]`; slots outside the row's keys (before its first key in the
    first block, after its last query, a shorter row's padding) are masked out.
    """

    token_start: int
    rows: int
    queries: int
    block_size: int
    read_block_ids: torch.Tensor  # [rows, blocks] int64 block id per block slot (padding repeats the last)
    mask: torch.Tensor  # [rows, 1, queries, keys] bool, True = attend; keys = blocks * block_size
    self_causal: bool = False  # row r's keys are its own queries' tokens, mask = causal (keys == queries)
    key_lo: torch.Tensor | None = None  # [rows] one-query calls: row r attends to key slots [key_lo[r], key_hi[r])
    key_hi: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # calls of several queries: `mask` as float32 0 / -inf, for SDPA



@dataclass(frozen=True, slots=True, kw_only=True)
class GroupMetadata:
    """Where one step's new tokens are written and what each query reads, for one group."""

    write_blocks: torch.Tensor  # [T] int64
    write_offsets: torch.Tensor  # [T] int64
    write_rows: torch.Tensor  # [T] int64 K row in the flat cache view (V: + block_size)
    calls: tuple[AttentionCall, ...]


def flat_rows(blocks: torch.Tensor, offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """K rows of (block, offset) pairs in a cache viewed as [num_blocks * 2 * block_size, kv_heads * D].

        row(block, kv, offset) = (block * 2 + kv) * block_size + offset      (kv: 0 = K, 1 = V)
    """
    return blocks * (2 * block_size) + offsets

@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledChunk:
    """One request's share of a step: positions [start_pos, end_pos) are computed now."""

    start_pos: int
    end_pos: int
    block_ids: Sequence[int]  # this group's block table of the request


@dataclass(frozen=True, slots=True)
class _Row:
    token_start: int
    q_start: int  # absolute position of the row's first query
    queries: int
    k_start: int
    table: int  # index into the step's chunks


def _rows(spans: Sequence[tuple[int, int]], rule: AttentionRule) -> list[_Row]:
    rows: list[_Row] = []
    token = 0
    tile = rule.tile_tokens
    for i, (start, end) in enumerate(spans):
        n = end - start
        step = tile if tile and n > rule.untiled_tokens else n
        for q_start in range(start, end, step):
            queries = min(step, end - q_start)
            rows.append(_Row(token + q_start - start, q_start, queries, rule.first_key(q_start), i))
        token += n
    return rows


@dataclass(frozen=True, slots=True, kw_only=True)
class _CallPlan:
    token_start: int
    rows: int
    queries: int
    table_rows: torch.Tensor  # [R] which chunk's block table each row reads
    span: torch.Tensor  # [R, B] index into the row's table slice (ReadPlan.table_slices) of each block slot
    mask: torch.Tensor  # [R, 1, Q, B * block size]
    attended: torch.Tensor  # [R, B] blocks at least one query of the row attends to
    self_causal: bool  # every row's keys are its own queries' positions under a plain causal mask
    key_lo: torch.Tensor | None  # [R] one-query rows: their keys are the slots [key_lo, key_hi)
    key_hi: torch.Tensor | None
    bias: torch.Tensor | None  # [R, 1, Q, B * block size] float32 0 (attend) / -inf: rows of several queries


def additive_mask(mask: np.ndarray) -> torch.Tensor:
    """A boolean mask (True = attend) as float32 0 / -inf. SDPA turns a boolean mask into exactly this
    on every call (the same result); a step's plan converts it once for all the layers of its groups
    (a 128-query sliding-window tile: ~11% less CPU time in SDPA)."""
    return torch.from_numpy(np.where(mask, np.float32(0), np.float32(-np.inf)))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadPlan:
    """The block-id-free part of a step's metadata: positions, rows, masks.

    Groups with the same rule and block size share one plan; `groups_metadata` adds the groups'
    block tables. Build it with `plan_reads`. Chunk i's step touches only entries [lo, hi) of its
    block table (`table_slices[i]`: from the block of its first key to that of its last token; a
    sliding-window decode reads ~W / block_size entries of a table as long as its prompt), and the
    indices below count from lo.
    """

    rule: AttentionRule
    block_size: int
    owner: torch.Tensor  # [T] chunk index of each flattened token
    table_index: torch.Tensor  # [T] position // block size - lo of the token's chunk
    offsets: torch.Tensor  # [T] position % block size
    table_slices: tuple[tuple[int, int], ...]  # per chunk: (lo, hi) of its block table
    calls: tuple[_CallPlan, ...]


def _call_plan(rows: Sequence[_Row], rule: AttentionRule, block_size: int, table_lo: np.ndarray) -> _CallPlan:
    """Blocks and mask of rows that share a query count: each row reads the blocks from the one of
    its first key to the one of its last query (padded to the call's widest row with its last block);
    `table_lo[i]`: the first table entry of chunk i that the plan keeps."""
    queries = rows[0].queries  # numpy: a step builds these for every call; torch ops cost ~5x more here
    q_start = np.array([r.q_start for r in rows], dtype=np.int64)  # [R]
    k_start = np.array([r.k_start for r in rows], dtype=np.int64)  # [R]
    table = np.array([r.table for r in rows], dtype=np.int64)  # [R]
    end = q_start + queries  # [R] one past the last query position
    first, last = k_start // block_size, (end - 1) // block_size  # [R] first / last block of each row
    width = int((last - first).max()) + 1
    span = np.minimum(first[:, None] + np.arange(width), last[:, None])  # [R, B]
    k_pos = first[:, None] * block_size + np.arange(width * block_size)  # [R, L] key position of each slot
    q_pos = q_start[:, None] + np.arange(queries)  # [R, Q]
    # causality leaves out the slots after a row's last query (its padding included); the window / chunk
    # rule those before its first key (full attention's first key is 0)
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [R, Q, L]
    if rule.kind is SpecKind.SLIDING_WINDOW:
        mask &= q_pos[:, :, None] - k_pos[:, None, :] < rule.window_tokens
    elif rule.kind is SpecKind.CHUNKED_LOCAL:
        mask &= (k_pos[:, None, :] // rule.chunk_tokens) == (q_pos[:, :, None] // rule.chunk_tokens)
    attended = mask.any(axis=1).reshape(len(rows), width, block_size).any(axis=2)  # [R, B]
    span -= table_lo[table][:, None]  # into the rows' table slices
    key_lo = key_hi = bias = None
    if queries == 1:  # one query: its keys are one run of slots (what the decode kernel reads)
        key_lo, key_hi = torch.from_numpy(k_start - first * block_size), torch.from_numpy(end - first * block_size)
    elif not all(_self_causal(r, rule) for r in rows):  # self-causal calls run SDPA's causal kernel, no mask
        bias = additive_mask(mask[:, None])
    return _CallPlan(token_start=rows[0].token_start, rows=len(rows), queries=queries,
                     table_rows=torch.from_numpy(table), span=torch.from_numpy(span),
                     mask=torch.from_numpy(mask[:, None]), attended=torch.from_numpy(attended),
                     self_causal=all(_self_causal(r, rule) for r in rows), key_lo=key_lo, key_hi=key_hi,
                     bias=bias)


def _self_causal(row: _Row, rule: AttentionRule) -> bool:
    """True when the row's queries see exactly the keys k <= q among their own positions."""
    last = row.q_start + row.queries - 1
    return row.k_start == row.q_start and rule.first_key(last) == row.q_start


_SPLIT_KEYS, _SPLIT_RATIO = 64, 1.25  # a call's rows are padded to its longest; split when that wastes much


def _outgrows(first: _Row, row: _Row) -> bool:
    """True when `row` reads many more keys than `first`, the first row of its call (rows are padded to the
    call's longest, so decodes ordered by length read about a quarter less with this split)."""
    keys, first_keys = row.q_start + row.queries - row.k_start, first.q_start + first.queries - first.k_start
    return keys - first_keys >= _SPLIT_KEYS and keys > _SPLIT_RATIO * first_keys


def plan_reads(spans: Sequence[tuple[int, int]], *, rule: AttentionRule, block_size: int,
               split_decodes: bool = True) -> ReadPlan:
    """The read plan of a step whose chunks compute positions [start, end) (flattened order).

    Rows of one query count share a call; a call is split where a row reads many more keys than
    its first (`_outgrows`: the torch path pads every row to the longest). `split_decodes=False`
    keeps all one-query rows of a run in one call, for the native decode kernel, which reads each
    row's own key range and pays one thread fork per call."""
    starts = np.array([a for a, _ in spans], dtype=np.int64)  # [N]
    lengths = np.array([b for _, b in spans], dtype=np.int64) - starts  # [N]
    owner = np.repeat(np.arange(len(spans)), lengths)  # [T]
    positions = np.arange(int(lengths.sum())) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)  # [T]
    slices = tuple((rule.first_key(a) // block_size, (b - 1) // block_size + 1) for a, b in spans)
    lo = np.array([s[0] for s in slices], dtype=np.int64)  # [N]
    rows = _rows(spans, rule)
    calls: list[_CallPlan] = []
    begin = 0
    for i in range(1, len(rows) + 1):
        if (i == len(rows) or rows[i].queries != rows[begin].queries
                or ((split_decodes or rows[begin].queries != 1) and _outgrows(rows[begin], rows[i]))):
            calls.append(_call_plan(rows[begin:i], rule, block_size, lo))
            begin = i
    table_index = positions // block_size - lo[owner]
    return ReadPlan(rule=rule, block_size=block_size, owner=torch.from_numpy(owner),
                    table_index=torch.from_numpy(table_index), offsets=torch.from_numpy(positions % block_size),
                    table_slices=slices, calls=tuple(calls))


def groups_metadata(plan: ReadPlan, block_tables: Sequence[Sequence[Sequence[int]]]) -> list[GroupMetadata]:
    """The metadata of groups sharing `plan`: `block_tables[g]` is group g's table of each chunk.

    The plan's table slices of every group and chunk become one tensor [G, N, width] (0 = null
    block, also where a table is shorter than the step needs: the checks below then fail), so
    groups of one plan cost one set of tensor ops, not one each.
    """
    width = max(hi - lo for lo, hi in plan.table_slices)
    padded = []
    for group_tables in block_tables:
        for table, (lo, hi) in zip(group_tables, plan.table_slices, strict=True):
            part = table[lo:hi]
            padded.append([*part, *[0] * (width - len(part))])
    tables = torch.tensor(padded, dtype=torch.int64).view(len(block_tables), len(plan.table_slices), width)
    write_blocks = tables[:, plan.owner, plan.table_index]  # [G, T]
    if bool((write_blocks == 0).any()):
        raise RuntimeError("internal error: a new token maps to the null block 0; its block was not allocated")
    write_rows = flat_rows(write_blocks, plan.offsets, plan.block_size)  # [G, T]
    reads = []
    for call in plan.calls:
        blocks = tables[:, call.table_rows].gather(2, call.span.expand(len(block_tables), -1, -1))  # [G, R, B]
        if bool(((blocks == 0) & call.attended).any()):
            raise RuntimeError(
                f"internal error: a {plan.rule.kind.value} query would read the null block 0; the KV cache "
                f"manager released a block that is still inside the attention range"
            )
        reads.append(blocks)
    return [
        GroupMetadata(write_blocks=write_blocks[g], write_offsets=plan.offsets, write_rows=write_rows[g],
                      calls=tuple(AttentionCall(token_start=call.token_start, rows=call.rows, queries=call.queries,
                                                block_size=plan.block_size, read_block_ids=blocks[g],
                                                mask=call.mask, self_causal=call.self_causal,
                                                key_lo=call.key_lo, key_hi=call.key_hi, bias=call.bias)
                                  for call, blocks in zip(plan.calls, reads, strict=True)))
        for g in range(len(block_tables))
    ]



def write_kv(cache: torch.Tensor, meta: GroupMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's new keys/values ([T, kv_heads, head_dim]) in a layer's paged cache."""
    flat = cache.view(-1, cache.shape[3] * cache.shape[4])  # [num_blocks * 2 * block_size, KVH*D]
    flat.index_copy_(0, meta.write_rows, k.reshape(k.shape[0], -1))
    flat.index_copy_(0, meta.write_rows + cache.shape[2], v.reshape(v.shape[0], -1))


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: GroupMetadata,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of the step's queries `q` [T, heads, head_dim] over a layer's paged K/V.

    `sinks` [heads]: learned per-head logits that join the softmax and carry no value (gpt-oss).
    `softcap`: tanh soft-capping of the scores (Gemma 2 style). `new_kv`: the step's new K and V
    [T, kv_heads, head_dim] as written by `write_kv` (None for a layer that reads another layer's
    cache); calls that attend only to their own new tokens then read them instead of the cache.
    Returns [T, heads, head_dim].
    """
    out = torch.empty_like(q)
    for call in meta.calls:
        n = call.rows * call.queries
        rows_q = q[call.token_start : call.token_start + n]  # [R*Q, H, D]
        if call.self_causal and new_kv is not None and sinks is None and softcap is None:
            k, v = (t[call.token_start : call.token_start + n] for t in new_kv)  # [R*Q, KVH, D] each
            result = _attend_self_causal(rows_q, k, v, call, scale=scale)
        else:
            result = _attend(rows_q, cache, call, scale=scale, sinks=sinks, softcap=softcap)
        out[call.token_start : call.token_start + n] = result
    return out


def _attend_self_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, *, scale: float
) -> torch.Tensor:
    """Causal attention of each row over its own new tokens: q [R*Q, H, D], k/v [R*Q, KVH, D]."""
    rows, queries = call.rows, call.queries
    q4 = q.view(rows, queries, q.shape[1], q.shape[2]).transpose(1, 2)  # [R, H, Q, D]
    k4 = k.view(rows, queries, k.shape[1], k.shape[2]).transpose(1, 2)  # [R, KVH, Q, D]
    v4 = v.view(rows, queries, v.shape[1], v.shape[2]).transpose(1, 2)  # [R, KVH, Q, D]
    o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)  # [R, H, Q, D]
    return o.transpose(1, 2).reshape(rows * queries, q.shape[1], q.shape[2])  # [R*Q, H, D]


def _kernel_reads(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """True when the native decode kernel can read this layer's cache in place (float32, contiguous)."""
    return cache.is_contiguous() and kernels.usable(q, cache)


def _attend(
    q: torch.Tensor,
    cache: torch.Tensor,
    call: AttentionCall,
    *,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    rows, queries = call.rows, call.queries
    heads, head_dim = q.shape[1], q.shape[2]
    if call.key_lo is not None and call.key_hi is not None and _kernel_reads(q, cache):
        return paged_decode(q, cache, call.read_block_ids, call.key_lo, call.key_hi, scale=scale,
                            softcap=softcap, sinks=sinks)
    kv_heads = cache.shape[3]
    groups = heads // kv_heads
    keys = call.mask.shape[-1]
    ids = call.read_block_ids.flatten()  # [R*B]: whole blocks, K and V each one contiguous run per block
    k = cache[:, 0].index_select(0, ids).view(rows, keys, kv_heads, head_dim).transpose(1, 2)  # [R, KVH, L, D]
    v = cache[:, 1].index_select(0, ids).view(rows, keys, kv_heads, head_dim).transpose(1, 2)  # [R, KVH, L, D]
    if sinks is None and softcap is None and queries == 1:  # decodes: the query heads of a KV head as its queries
        q4 = q.view(rows, kv_heads, groups, head_dim)  # [R, KVH, G, D]
        o = F.scaled_dot_product_attention(q4, k, v, attn_mask=call.mask, scale=scale)  # [R, KVH, G, D]
        return o.reshape(rows, heads, head_dim)  # [R, H, D]
    if sinks is None and softcap is None:
        q4 = q.view(rows, queries, heads, head_dim).transpose(1, 2)  # [R, H, Q, D]
        mask = call.mask if call.bias is None else call.bias
        o = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(rows * queries, heads, head_dim)  # [R*Q, H, D]
    # sinks and soft-capping: explicit scores. Fold the query heads sharing a KV head into the
    # query axis: no K/V repeat is needed.
    q = q.view(rows, queries, kv_heads, groups, head_dim)  # [R, Q, KVH, G, D]
    q = q.permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, groups * queries, head_dim)  # [R, KVH, G*Q, D]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [R, KVH, G*Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(rows, kv_heads, groups, queries, keys).masked_fill(~call.mask[:, :, None], float("-inf"))
    scores = scores.view(rows, kv_heads, groups * queries, keys)  # [R, KVH, G*Q, L]
    if sinks is not None:
        sink = sinks.view(kv_heads, groups, 1).expand(kv_heads, groups, queries)  # [KVH, G, Q]
        sink = sink.reshape(1, kv_heads, groups * queries, 1).expand(rows, -1, -1, 1)  # [R, KVH, G*Q, 1]
        probs = torch.softmax(torch.cat([scores, sink.to(scores.dtype)], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v)  # [R, KVH, G*Q, D]
    o = o.view(rows, kv_heads, groups, queries, head_dim).permute(0, 3, 1, 2, 4)  # [R, Q, KVH, G, D]
    return o.reshape(rows * queries, heads, head_dim)  # [R*Q, H, D]
