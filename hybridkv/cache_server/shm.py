"""The engine's KV cache buffers, mapped into the server (POSIX shared memory, no copies of
the mapping itself): page views by (buffer, block id) for the store to copy from and into. A
segment named by several buffers (DeepSeek-V4's packed layout: one per group layer, each at its
offset in every block) is mapped once.

The server opens `/dev/shm/<name>` directly (not `multiprocessing.shared_memory`, whose
resource tracker would unlink the engine's segment when the server exits).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

from hybridkv.cache_server.registered_layout import RequestError, buffer_strides
from hybridkv.wire import ErrorCode, Layout

SHM_DIR = Path("/dev/shm")

Bytes = npt.NDArray[np.uint8]


class MappedBuffers:
    """Read/write views of one registered engine's buffers. Close when the engine unregisters."""

    def __init__(self, layout: Layout) -> None:
        self.num_blocks = layout.num_blocks
        self.strides = buffer_strides(layout)
        self.offsets = [buf.offset_bytes for buf in layout.buffers]
        self._maps: list[mmap.mmap] = []
        self.views: list[Bytes] = []
        sizes: dict[str, int] = {}
        for buf in layout.buffers:
            sizes[buf.shm_name] = max(sizes.get(buf.shm_name, 0), buf.size_bytes)
        try:
            mapped = {name: self._map(name, size) for name, size in sizes.items()}
        except BaseException:
            self.close()
            raise
        self.views = [mapped[buf.shm_name] for buf in layout.buffers]

    def _map(self, name: str, size_bytes: int) -> Bytes:
        if not name or "/" in name:
            raise RequestError(ErrorCode.BAD_LAYOUT, f"shared-memory name must be non-empty without '/', got {name!r}")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise RequestError(ErrorCode.BAD_LAYOUT, f"cannot open shared memory {name!r}: {e.strerror}") from None
        try:
            actual = os.fstat(fd).st_size
            if actual < size_bytes:
                raise RequestError(ErrorCode.BAD_LAYOUT, f"shared memory {name!r} has {actual} bytes, the layout "
                                   f"says {size_bytes}")
            # populate: fault the whole mapping now (registration), not page by page in every copy
            mapped = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._maps.append(mapped)
        return np.frombuffer(mapped, dtype=np.uint8)

    def check_block_ids(self, what: str, block_ids: list[int]) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise RequestError(ErrorCode.BAD_REQUEST, f"{what}: block id {b} is outside the registered "
                                   f"buffers (expected 0 <= id < num_blocks = {self.num_blocks})")

    def page(self, buffer: int, block_id: int, nbytes: int) -> Bytes:
        start = self.offsets[buffer] + block_id * self.strides[buffer]
        return self.views[buffer][start:start + nbytes]

    def close(self) -> None:
        self.views.clear()
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still exported: the OS unmaps at exit
                m.close()
        self._maps.clear()
