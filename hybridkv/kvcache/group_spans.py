"""Per-group values written a manager at a time: a manager's groups are usually a range of group ids
(the multi-page state layout: hundreds of page groups of one state), so one slice, not a loop."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from hybridkv.kvcache.eviction import Ids


@lru_cache(maxsize=256)
def span(group_ids: tuple[int, ...]) -> slice | None:
    """`group_ids` as a slice where they are consecutive and ascending, else None."""
    first = group_ids[0]
    return slice(first, first + len(group_ids)) if group_ids == tuple(range(first, first + len(group_ids))) else None


def put_groups(values: list[Any], group_ids: tuple[int, ...], items: Sequence[Any]) -> None:
    """`values[g] = items[i]` for the i-th of `group_ids`."""
    at = span(group_ids)
    if at is not None:
        values[at] = items
        return
    for g, item in zip(group_ids, items, strict=True):
        values[g] = item


def new_block_rows(group_ids: tuple[int, ...], flat: Ids | None, starts: list[int],
                   fresh: list[Sequence[int] | Ids] | None) -> Sequence[Sequence[int] | Ids] | Ids:
    """The new blocks of one manager's groups from the step's pop (`flat`, group after group; group g's
    are `flat[starts[g]:starts[g + 1]]`; or `fresh`, per group, after copy on write took its blocks):
    one (groups, n) slice of the pop where the groups are a range (each takes as many), else per group."""
    if fresh is not None:
        return [fresh[g] for g in group_ids]
    if flat is None:
        return [[]] * len(group_ids)
    at = span(group_ids)
    if at is not None:
        count = starts[at.start + 1] - starts[at.start]
        if starts[at.stop] - starts[at.start] == count * len(group_ids):
            return flat[starts[at.start] : starts[at.stop]].reshape(len(group_ids), count)
    return [flat[starts[g] : starts[g + 1]] for g in group_ids]


def row_tuples(rows: Ids) -> list[tuple[int, ...]]:
    """Each row of `rows` (groups, n) as a tuple of ints; rows null but in their last entry (a running
    state's table grown by a chunk: hundreds of page groups x a hundred entries) without converting the nulls."""
    if rows.shape[1] > 1 and not np.count_nonzero(rows[:, :-1]):
        nulls = (0,) * (rows.shape[1] - 1)
        return [(*nulls, last) for last in rows[:, -1].tolist()]
    return list(map(tuple, rows.tolist()))
