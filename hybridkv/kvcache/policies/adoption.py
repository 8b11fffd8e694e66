"""State adoption (`RunningState.ADOPT`): a state hit moved into the new request's running state.

With one running state per request, a hit on a state checkpoint is copied into the request's
running block. When the checkpoint is the end of a finished request that no hit has used yet
(the next chat turn or agent step taking over: `Anchors.fresh_end`), nobody else is expected to
hit it, so it is moved instead (no copy, the block leaves the cache) -- unless another waiting
request's hit ends there too (the scheduler names those each step through `protect_waiting`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.ids import BlockHash


class StateAdoption:
    """Decides whether a state hit may be moved (module docstring); counts the moves."""

    def __init__(self, pool: BlockPool, fresh_end: Callable[[BlockHash], bool]) -> None:
        self._pool = pool
        self._fresh_end = fresh_end
        #: per state checkpoint (its first block): the waiting requests whose hit ends there (this step)
        self.waiting_states: dict[int, int] = {}
        #: state hits moved into running states, since construction
        self.adoptions = 0

    def allows(self, blocks: Sequence[int]) -> bool:
        """The state hit `blocks` (one per page group) may become the new request's running state:
        a fresh end, held by nobody, and no other waiting request's hit ends there."""
        if any(self._pool.ref_cnt.item(b) for b in blocks):
            return False
        key = self._pool.hash_of(blocks[0])
        return key is not None and self._fresh_end(key) and self.waiting_states.get(blocks[0], 0) <= 1

    def waiting(self, block: int) -> None:
        """A waiting request's hit ends at the state checkpoint whose first block is `block`."""
        self.waiting_states[block] = self.waiting_states.get(block, 0) + 1

    def new_step(self) -> None:
        self.waiting_states.clear()
