"""`KVCacheManager.check_integrity`: every table against the pool's reference counts and maps."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hybridkv.errors import IntegrityError
from hybridkv.kvcache.block_pool import NULL, BlockPool
from hybridkv.kvcache.coordinator import KVCacheCoordinator
from hybridkv.kvcache.running_state import fixed_state_managers
from hybridkv.kvcache.type_managers.base import SingleTypeManager


def check_manager_integrity(groups: Sequence[tuple[SingleTypeManager, int]], coordinator: KVCacheCoordinator,
                            pool: BlockPool) -> None:
    """Raise `IntegrityError` with the actual numbers if any invariant is broken (`groups[g]`: the
    manager and row of group g): ref counts equal the number of tables holding a block (plus the
    ends of copies not taken yet), free queue == blocks with ref count 0, no block twice in a table,
    every held block belongs to the group holding it, hash maps consistent."""
    expected: Counter[int] = Counter()
    group_of = pool.group_of.tolist()
    running = set(coordinator.running_requests())
    for g, (manager, row) in enumerate(groups):
        tables = manager.tables(row)
        if set(tables) != running:
            raise IntegrityError(f"group {g} has tables for {sorted(tables)} but the "
                                 f"running requests are {sorted(running)}")
        for rid, table in tables.items():
            skipped = manager.num_skipped(rid)
            if any(table[:skipped]):
                raise IntegrityError(f"request {rid!r} group {g}: the first {skipped} entries should be null")
            real = [b for b in table if b != NULL]
            if len(set(real)) != len(real):
                raise IntegrityError(f"request {rid!r} holds a block twice in group {g}")
            for block in real:
                if not 0 < block < len(group_of):
                    raise IntegrityError(f"request {rid!r} holds block {block} in group {g}, outside the pool")
                if group_of[block] != g:
                    raise IntegrityError(f"request {rid!r} holds block {block} in group {g} "
                                         f"but the block belongs to group {group_of[block]}")
                expected[block] += 1
    expected.update(coordinator.cow.retained)  # the ends of copies not taken yet
    for manager in fixed_state_managers(coordinator.managers):
        expected.update(manager.held_checkpoints)  # taken in this schedule (running_state.py)
    pool.check_integrity(expected)
