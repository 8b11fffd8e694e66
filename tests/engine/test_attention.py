"""Paged attention metadata and math on hand-computed vectors (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv.engine.attention import (
    AttentionRule,
    ScheduledChunk,
    groups_metadata,
    paged_attention,
    plan_reads,
    write_kv,
)
from hybridkv.plan.specs import SpecKind
from tests.engine.attention_helpers import build_group_metadata, read_blocks, read_offsets

FULL = AttentionRule(kind=SpecKind.FULL)


def sliding(window: int) -> AttentionRule:
    return AttentionRule(kind=SpecKind.SLIDING_WINDOW, window_tokens=window)


def test_sliding_window_reads_only_the_window_and_skips_the_null_block() -> None:
    # W = 3, block size 2: positions 0-1 were released (null block 0), 2-3 live in block 7, 4-5 in block 9.
    meta = build_group_metadata([ScheduledChunk(start_pos=4, end_pos=6, block_ids=[0, 7, 9])],
                                rule=sliding(3), block_size=2)
    assert meta.write_blocks.tolist() == [9, 9]
    assert meta.write_offsets.tolist() == [0, 1]
    (call,) = meta.calls
    assert (call.rows, call.queries) == (1, 2)
    assert read_blocks(call).tolist() == [[7, 7, 9, 9]]  # key positions 2, 3, 4, 5
    assert read_offsets(call).tolist() == [[0, 1, 0, 1]]
    assert call.mask[0, 0].tolist() == [[True, True, True, False], [False, True, True, True]]


def test_decodes_of_different_lengths_share_one_padded_call() -> None:
    chunks = [ScheduledChunk(start_pos=2, end_pos=3, block_ids=[3, 4]),
              ScheduledChunk(start_pos=4, end_pos=5, block_ids=[5, 6, 8])]
    (call,) = build_group_metadata(chunks, rule=FULL, block_size=2).calls
    assert (call.rows, call.queries) == (2, 1)
    # whole blocks: row 0 reads blocks 3, 4 (keys 0-2, slot 3 is past its query) padded with its last block
    assert call.read_block_ids.tolist() == [[3, 4, 4], [5, 6, 8]]
    assert read_blocks(call).tolist() == [[3, 3, 4, 4, 4, 4], [5, 5, 6, 6, 8, 8]]
    assert read_offsets(call).tolist() == [[0, 1, 0, 1, 0, 1]] * 2
    assert call.mask[:, 0, 0].tolist() == [[True, True, True, False, False, False], [True] * 5 + [False]]


def test_chunked_local_attends_within_the_chunk() -> None:
    rule = AttentionRule(kind=SpecKind.CHUNKED_LOCAL, chunk_tokens=4)
    (call,) = build_group_metadata([ScheduledChunk(start_pos=5, end_pos=7, block_ids=[0, 0, 2, 3])],
                                   rule=rule, block_size=2).calls
    assert read_blocks(call).tolist() == [[2, 2, 3, 3]]  # keys 4, 5, 6 of chunk [4, 8); slot 7 is never seen
    assert call.mask[0, 0].tolist() == [[True, True, False, False], [True, True, True, False]]


def test_long_prefill_of_a_window_group_is_cut_into_tiles() -> None:
    meta = build_group_metadata([ScheduledChunk(start_pos=0, end_pos=40, block_ids=list(range(1, 11)))],
                                rule=sliding(8), block_size=4)
    assert [(c.token_start, c.rows, c.queries) for c in meta.calls] == [(0, 2, 16), (32, 1, 8)]
    tiles = meta.calls[0]
    # a tile sees its queries plus W - 1 earlier keys: tile 2 keys 9-31, i.e. the 6 blocks of keys 8-31;
    # tile 1 (keys 0-15, 4 blocks) is padded to 6 with its last block
    assert tiles.read_block_ids.tolist() == [[1, 2, 3, 4, 4, 4], [3, 4, 5, 6, 7, 8]]
    assert tiles.mask.shape == (2, 1, 16, 24)
    assert tiles.mask[1, 0, 0].tolist() == [False] + [True] * 8 + [False] * 15  # query 16 sees keys 9-16
    assert not tiles.mask[0, 0, :, 16:].any()  # tile 1's padding
    assert tiles.bias is not None and tiles.bias.dtype == torch.float32  # the mask as SDPA's additive form
    assert tiles.bias[1, 0, 0, :10].tolist() == [-math.inf] + [0.0] * 8 + [-math.inf]
    assert torch.equal(tiles.bias == 0, tiles.mask)
    assert meta.calls[1].bias is not None  # the last tile also reads earlier keys


def test_only_masked_calls_of_several_queries_carry_an_additive_mask() -> None:
    prompt = build_group_metadata([ScheduledChunk(start_pos=0, end_pos=8, block_ids=[1, 2])], rule=FULL, block_size=4)
    decode = build_group_metadata([ScheduledChunk(start_pos=8, end_pos=9, block_ids=[1, 2, 3])], rule=FULL,
                                  block_size=4)
    assert prompt.calls[0].self_causal and prompt.calls[0].bias is None  # SDPA's causal kernel, no mask
    assert decode.calls[0].queries == 1 and decode.calls[0].bias is None  # the decode kernel


def test_sdpa_gives_the_same_bits_with_the_additive_mask_as_with_the_boolean_one() -> None:
    meta = build_group_metadata([ScheduledChunk(start_pos=0, end_pos=40, block_ids=list(range(1, 11)))],
                                rule=sliding(8), block_size=4)
    call = meta.calls[0]
    assert call.bias is not None
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(call.rows, 4, call.queries, 8, generator=gen)
    k, v = (torch.randn(call.rows, 2, call.mask.shape[-1], 8, generator=gen) for _ in range(2))
    with_bool = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=call.mask, enable_gqa=True)
    with_bias = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=call.bias, enable_gqa=True)
    assert torch.equal(with_bool, with_bias)


def test_groups_sharing_a_plan_each_read_their_own_tables() -> None:
    # W = 3, block size 2; two chunks: a decode at position 6 and a 2-token chunk at 4-5.
    plan = plan_reads([(6, 7), (4, 6)], rule=sliding(3), block_size=2)
    assert plan.table_slices == ((2, 4), (1, 3))  # blocks of positions 4-6 and 2-5 only
    group_a = [[0, 0, 11, 12], [0, 21, 22]]
    group_b = [[0, 0, 31, 32], [0, 41, 42]]
    a, b = groups_metadata(plan, [group_a, group_b])
    assert a.write_blocks.tolist() == [12, 22, 22] and b.write_blocks.tolist() == [32, 42, 42]
    assert [c.read_block_ids.tolist() for c in a.calls] == [[[11, 12]], [[21, 22]]]
    assert [c.read_block_ids.tolist() for c in b.calls] == [[[31, 32]], [[41, 42]]]
    assert a.write_rows.tolist() == [12 * 4 + 0, 22 * 4 + 0, 22 * 4 + 1]  # (block * 2 + K) * block_size + offset


def test_decodes_share_one_call_unless_split_by_length() -> None:
    spans = [(10, 11), (200, 201), (900, 901)]  # three decodes of very different lengths, block size 16
    split = plan_reads(spans, rule=FULL, block_size=16)
    assert [c.rows for c in split.calls] == [1, 1, 1]  # each outgrows the one before (padded torch path)
    one = plan_reads(spans, rule=FULL, block_size=16, split_decodes=False)
    assert [c.rows for c in one.calls] == [3]
    call = one.calls[0]
    assert call.key_lo is not None and call.key_hi is not None
    assert call.key_lo.tolist() == [0, 0, 0] and call.key_hi.tolist() == [11, 201, 901]  # each row's own keys
    window = plan_reads(spans, rule=sliding(64), block_size=16, split_decodes=False).calls[0]
    assert window.key_lo is not None and window.key_hi is not None  # slots count from each row's first block
    assert window.key_lo.tolist() == [0, (200 - 63) % 16, (900 - 63) % 16]
    assert (window.key_hi - window.key_lo).tolist() == [11, 64, 64]


def test_a_table_shorter_than_the_step_is_an_internal_error() -> None:
    plan = plan_reads([(4, 6)], rule=FULL, block_size=2)
    with pytest.raises(RuntimeError, match="not allocated"):
        groups_metadata(plan, [[[1, 2, 3]], [[4, 5]]])  # the second group lacks the block of positions 4-5


def test_a_null_block_inside_the_window_is_an_internal_error() -> None:
    with pytest.raises(RuntimeError, match="null block"):
        build_group_metadata([ScheduledChunk(start_pos=4, end_pos=5, block_ids=[0, 0, 9])],
                             rule=sliding(4), block_size=2)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor | None,
           softcap: float | None) -> torch.Tensor:
    """Causal attention of one sequence, GQA by repetition; q [T, H, D], k/v [T, KVH, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [T, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    t = q.shape[0]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, t, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :t]
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize(("sinks", "softcap"), [(False, None), (True, None), (False, 5.0)])
def test_paged_attention_equals_dense_attention(sinks: bool, softcap: float | None) -> None:
    torch.manual_seed(0)
    t, heads, kv_heads, dim, block = 10, 4, 2, 8, 4
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    sink = torch.randn(heads) if sinks else None
    cache = torch.full((8, 2, block, kv_heads, dim), 1e4)  # unwritten slots of read blocks: masked out
    table = [5, 2, 7]
    expected = _dense(q, k, v, 0.3, sink, softcap)
    # Prefill 6 tokens, then decode the remaining 4 one by one.
    for start, end in [(0, 6), (6, 7), (7, 8), (8, 9), (9, 10)]:
        meta = build_group_metadata([ScheduledChunk(start_pos=start, end_pos=end, block_ids=table)],
                                    rule=FULL, block_size=block)
        write_kv(cache, meta, k[start:end], v[start:end])
        out = paged_attention(q[start:end], cache, meta, scale=0.3, sinks=sink, softcap=softcap)
        torch.testing.assert_close(out, expected[start:end], atol=1e-5, rtol=1e-5)


def _dense_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule: AttentionRule) -> torch.Tensor:
    """Reference: every query attends to keys [rule.first_key(p), p], GQA by repetition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [T, H, D]
    out = torch.empty_like(q)
    for p in range(q.shape[0]):
        first = rule.first_key(p)
        probs = torch.softmax(torch.einsum("hd,khd->hk", q[p], k[first : p + 1]) * 0.3, dim=-1)  # [H, K]
        out[p] = torch.einsum("hk,khd->hd", probs, v[first : p + 1])
    return out


@pytest.mark.parametrize("block", [2, 4, 8])
@pytest.mark.parametrize("rule", [sliding(5), AttentionRule(kind=SpecKind.CHUNKED_LOCAL, chunk_tokens=8)],
                         ids=["sliding5", "chunked8"])
def test_window_groups_equal_dense_attention_with_released_blocks_never_read(
    rule: AttentionRule, block: int
) -> None:
    torch.manual_seed(0)
    t, heads, kv_heads, dim = 40, 4, 2, 8
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    num_blocks = t // block + 2
    # Rows read whole blocks, so the unwritten slots of a row's first and last block are read but must be
    # masked out: they hold a finite poison that would dominate any output that attended to them. The null
    # block 0 (released blocks) must never be read at all: NaN there turns any output that read it into NaN.
    cache = torch.full((num_blocks, 2, block, kv_heads, dim), 1e4)
    cache[0] = float("nan")
    table = list(range(1, t // block + 1))
    expected = _dense_local(q, k, v, rule)
    steps = [(0, 3), (3, 17), (17, 18), (18, 19), (19, 36), (36, 37), (37, 38), (38, 39), (39, 40)]
    for start, end in steps:
        # release (null out) every block wholly before the first key of this step's first query
        released = rule.first_key(start) // block
        live = [0] * released + table[released : -(-end // block)]
        meta = build_group_metadata([ScheduledChunk(start_pos=start, end_pos=end, block_ids=live)],
                                    rule=rule, block_size=block)
        write_kv(cache, meta, k[start:end], v[start:end])
        out = paged_attention(q[start:end], cache, meta, scale=0.3)
        torch.testing.assert_close(out, expected[start:end], atol=1e-5, rtol=1e-5)
