"""Test-only views of the engine's attention plans: one group's metadata from chunks, key slots spelled out."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.engine.attention import (
    AttentionCall,
    AttentionRule,
    GroupMetadata,
    ScheduledChunk,
    groups_metadata,
    plan_reads,
)


def build_group_metadata(
    chunks: Sequence[ScheduledChunk], *, rule: AttentionRule, block_size: int
) -> GroupMetadata:
    """Slot mapping and read plan of one group for a step (chunks in flattened token order)."""
    plan = plan_reads([(c.start_pos, c.end_pos) for c in chunks], rule=rule, block_size=block_size)
    return groups_metadata(plan, [[c.block_ids for c in chunks]])[0]


def read_blocks(call: AttentionCall) -> torch.Tensor:
    """[rows, keys] block id of each key slot."""
    return call.read_block_ids.repeat_interleave(call.block_size, dim=1)


def read_offsets(call: AttentionCall) -> torch.Tensor:
    """[rows, keys] offset of each key slot in its block."""
    keys = call.read_block_ids.shape[1] * call.block_size
    return (torch.arange(keys) % call.block_size).expand(call.rows, keys)
