"""The engine's KV cache buffers, mapped into the server from the file descriptors the engine
passed when it registered: page views by (buffer, block id) for the store to copy from and into.
A segment named by several buffers (DeepSeek-V4's packed layout: one per group layer, each at its
offset in every block) is one descriptor, mapped once.

The server never opens a path: a client can only hand over memory it holds itself (a descriptor
opened read-only cannot be mapped for writing), so no name, symlink or other tenant's segment can
be named. Each descriptor must be a memfd sealed against shrinking (`F_SEAL_SHRINK`): a mapping of
a file that shrinks raises SIGBUS on the next copy, which would end the server for every client.

Prefaulting for writes: a retrieve writes the engine's pages through this mapping. A page table
entry made by a read fault (what `MAP_POPULATE` makes on a shared mapping) is clean, and the first
write through it has the CPU set its dirty bit, which in a VM measured half the copy's speed: the
server spent 44 ms of CPU per 268 MB retrieved against 23 ms once the entries were made by write
faults (`benchmarks/bench_server.py`, retrieve 0.4-0.5 -> ~0.9 of memcpy). So a mapping whose pages
the engine has allocated is prefaulted for writing with `MADV_POPULATE_WRITE` (Linux 5.14+; it
writes no byte, so the engine's KV is untouched), on a helper thread, a slice at a time: a
registration of tens of GiB answers at once instead of holding every other client's request while
its page tables are built (0.3 s per GiB here). A copy that comes first just faults its pages in
itself. Without the madvise (an older kernel) the mapping is made with `MAP_POPULATE` as before.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import sys
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.cache_server.registered_layout import RequestError, buffer_strides
from hybridkv.wire import ErrorCode, Layout, segment_labels

Bytes = npt.NDArray[np.uint8]


def _fully_allocated(st: os.stat_result) -> bool:
    """Whether the owner has allocated every page of the segment (SharedKVBuffers does, at creation).
    Only then is it prefaulted: a segment with holes is mapped lazily, as prefaulting it would allocate
    gigabytes on the client's behalf."""
    return st.st_blocks * 512 >= st.st_size  # st_blocks counts 512-byte units whatever the file system


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14+
PREFAULT_SLICE_BYTES = 32 << 20  # what a close waits for at most: one slice (~10 ms)


def _populate_write_works() -> bool:
    """Whether this kernel knows MADV_POPULATE_WRITE (tried once on a page of anonymous memory)."""
    size = mmap.PAGESIZE
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr is None or addr == _MAP_FAILED:
        return False
    try:
        return bool(_libc.madvise(addr, size, MADV_POPULATE_WRITE) == 0)
    finally:
        _libc.munmap(addr, size)


POPULATE_WRITE = sys.platform == "linux" and _populate_write_works()


class Prefaulter:
    """Prefaults spans of mappings for writing on a helper thread, slice by slice; `stop` returns
    within one slice. The spans must stay mapped until `stop` returned."""

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(spans),), name="hybridkv-prefault", daemon=True)
        self._thread.start()

    def _run(self, spans: list[tuple[int, int]]) -> None:
        try:
            for addr, size in spans:
                for start in range(0, size, PREFAULT_SLICE_BYTES):
                    if self._stop.is_set():
                        return
                    # ctypes lets go of the GIL: the control loop serves other clients meanwhile. A
                    # failure (memory pressure) leaves the rest to fault in on first use, as before.
                    if _libc.madvise(addr + start, min(PREFAULT_SLICE_BYTES, size - start), MADV_POPULATE_WRITE):
                        return
        finally:
            self.done.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _Mapping:
    """A shared read-write mapping that keeps no descriptor open. Python's `mmap.mmap` keeps a
    duplicate of the descriptor for as long as it lives: one per segment of every registration, so
    a client registering many segments used to take every descriptor the server had (issue 46)."""

    def __init__(self, fd: int, size_bytes: int, flags: int) -> None:
        addr = _libc.mmap(None, size_bytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self._addr: int | None = addr
        self.addr, self.size = addr, size_bytes
        self.view: Bytes = np.frombuffer(memoryview((ctypes.c_uint8 * size_bytes).from_address(addr)), dtype=np.uint8)

    def close(self) -> None:
        """Unmap, unless a view of it is still referenced elsewhere (then the mapping stays until the
        process exits: unmapping under a live view would crash the server on its next use)."""
        if self._addr is None:
            return
        if sys.getrefcount(self.view) > 2:  # this attribute and getrefcount's own argument
            return
        self.view = np.empty(0, dtype=np.uint8)
        _libc.munmap(self._addr, self.size)
        self._addr = None


class MappedBuffers:
    """Read/write views of one registered engine's buffers. Close when the engine unregisters.

    `fds`: one descriptor per `segment_labels(layout)`; the caller keeps ownership (closes them)."""

    def __init__(self, layout: Layout, fds: Sequence[int]) -> None:
        self.num_blocks = layout.num_blocks
        self.strides = buffer_strides(layout)
        self.offsets = [buf.offset_bytes for buf in layout.buffers]
        self.prefaulter: Prefaulter | None = None
        self._maps: list[_Mapping] = []
        self._prefault: list[tuple[int, int]] = []  # (address, bytes) of the mappings to prefault
        self.views: list[Bytes] = []
        names = segment_labels(layout)
        if len(fds) != len(names):
            raise RequestError(ErrorCode.BAD_LAYOUT, f"the layout names {len(names)} segments, the register "
                               f"message passed {len(fds)} file descriptors (one per segment expected)")
        sizes: dict[str, int] = {}
        for buf in layout.buffers:
            sizes[buf.shm_name] = max(sizes.get(buf.shm_name, 0), buf.size_bytes)
        try:
            mapped = {name: self._map(name, fd, sizes[name]) for name, fd in zip(names, fds, strict=True)}
        except BaseException:
            self.close()
            raise
        self.views = [mapped[buf.shm_name] for buf in layout.buffers]
        self.prefaulter = Prefaulter(self._prefault) if self._prefault else None

    def _map(self, name: str, fd: int, size_bytes: int) -> Bytes:
        def bad(why: str) -> RequestError:
            return RequestError(ErrorCode.BAD_LAYOUT, f"segment {name!r:.80}: {why}")

        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise bad(f"the descriptor is not a regular file (mode {oct(st.st_mode)}); expected a memfd")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise bad("the descriptor is not sealed against shrinking; expected a memfd created with "
                      "MFD_ALLOW_SEALING and sealed with F_SEAL_SHRINK (a file that shrinks would crash the server)")
        if st.st_size < size_bytes:
            raise bad(f"has {st.st_size} bytes, the layout says {size_bytes}")
        prefault = _fully_allocated(st)
        populate = getattr(mmap, "MAP_POPULATE", 0) if prefault and not POPULATE_WRITE else 0
        try:
            mapped = _Mapping(fd, size_bytes, mmap.MAP_SHARED | populate)
        except OSError as e:
            raise bad(f"cannot be mapped read-write: {e.strerror} (pass a descriptor opened read-write)") from None
        self._maps.append(mapped)
        if prefault and POPULATE_WRITE:
            self._prefault.append((mapped.addr, mapped.size))
        return mapped.view

    @property
    def prefaulting(self) -> bool:
        """Whether the helper thread is still prefaulting the segments (copies work meanwhile, slower)."""
        return self.prefaulter is not None and not self.prefaulter.done.is_set()

    @property
    def segments(self) -> int:
        return len(self._maps)

    def check_block_ids(self, what: str, block_ids: list[int]) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise RequestError(ErrorCode.BAD_REQUEST, f"{what}: block id {b} is outside the registered "
                                   f"buffers (expected 0 <= id < num_blocks = {self.num_blocks})")

    def page(self, buffer: int, block_id: int, nbytes: int) -> Bytes:
        start = self.offsets[buffer] + block_id * self.strides[buffer]
        return self.views[buffer][start:start + nbytes]

    def close(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.stop()  # before any unmap: it must never touch a range mapped again for another
        self.views.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()
