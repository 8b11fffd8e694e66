"""Typed identifiers shared by the KV cache manager layers.

`BlockId`, `GroupId` and `RequestId` are `NewType`s so mypy keeps a block id from being passed
where a group id is expected; at run time they are plain `int` / `str`. `BlockHash` is the
digest of one full block (see `hashing.py`); it is an alias, not a NewType, because hashes are
produced in the hashing hot loop where a wrapper call per block would cost measurable time.
"""

from __future__ import annotations

from typing import NewType, TypeAlias

BlockId = NewType("BlockId", int)
GroupId = NewType("GroupId", int)
RequestId = NewType("RequestId", str)
BlockHash: TypeAlias = bytes

NULL_BLOCK_ID = BlockId(0)
NULL = 0  # the same id as a plain int (the pool's arrays): the placeholder for positions a group does not keep
NULL_REF_CNT = 1 << 62  # the null block's ref count, never changed
