"""The L1 pool's memory: one anonymous mapping of `--l1-size-gib`, pre-faulted at startup and
carved into extents (first fit, free neighbours coalesce).

Why not one numpy array per object: on this machine kind a fresh page costs a fault (tens of
microseconds in a VM), which caps copies into new memory near 0.1-0.3 GB/s; copies into memory
that was faulted once run at memcpy speed. Faulting the pool once at startup moves that cost out
of every store.

    | used | free ......... | used | used | free .. |     extents: (offset, bytes), 64-byte aligned
"""

from __future__ import annotations

import bisect
import mmap

import numpy as np

from hybridkv.cache_server.shm import Bytes
from hybridkv.errors import IntegrityError

ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = aligned(capacity_bytes) if capacity_bytes > 0 else ALIGN
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, self.capacity_bytes, flags=flags)
        self.view: Bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._starts = [0]  # sorted offsets of free extents
        self._sizes = {0: self.capacity_bytes}  # free extent offset -> bytes
        self.free_bytes = self.capacity_bytes

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of `nbytes` (rounded up to 64), or None if no free extent fits."""
        need = aligned(max(nbytes, 1))
        for i, start in enumerate(self._starts):
            size = self._sizes[start]
            if size >= need:
                del self._sizes[start]
                if size == need:
                    del self._starts[i]
                else:
                    self._starts[i] = start + need
                    self._sizes[start + need] = size - need
                self.free_bytes -= need
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = aligned(max(nbytes, 1))
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < offset + size) or (
                i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] > offset):
            raise IntegrityError(f"arena: free of [{offset}, {offset + size}) overlaps a free extent")
        self.free_bytes += size
        if i < len(self._starts) and self._starts[i] == offset + size:  # merge with the next
            size += self._sizes.pop(self._starts.pop(i))
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:  # and the previous
            self._sizes[self._starts[i - 1]] += size
            return
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    def check_integrity(self, used_bytes: int) -> None:
        free = sum(self._sizes.values())
        if free != self.free_bytes or free + used_bytes != self.capacity_bytes or sorted(self._sizes) != self._starts:
            raise IntegrityError(f"arena: {free} bytes in free extents (counted {self.free_bytes}), {used_bytes} "
                                 f"used, capacity {self.capacity_bytes}")
