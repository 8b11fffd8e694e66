"""The engine's KV cache segments: anonymous memory (memfd) the engine hands to the server as file
descriptors when it registers (docs/cache_server_security.md).

    buffers = SharedKVBuffers.create(num_buffers=2, size_bytes=num_blocks * page_stride)
    buffers.arrays[j]            # a numpy view of segment j (torch.from_numpy works on it)
    buffers.buffer_layouts()     # their wire descriptions (labels and sizes) for the layout
    KVClient.register(layout)    # finds the descriptors of the layout's labels here (this process)

Each segment is a memfd sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL`): the server maps it and can trust its size for as long as it holds it, and no name
in /dev/shm exists that another process could open, replace or link. The memory goes when the
engine and the server have both let go of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.errors import ConfigError
from hybridkv.wire import BufferLayout

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_open: dict[str, int] = {}  # label -> descriptor of every live segment of this process
_open_lock = threading.Lock()


def segment_fds(labels: Sequence[str]) -> list[int]:
    """The descriptors of this process's segments with these labels (ConfigError naming a missing one)."""
    with _open_lock:
        missing = [label for label in labels if label not in _open]
        if missing:
            raise ConfigError(f"segment {missing[0]!r:.80} was not created by SharedKVBuffers in this process (or "
                              "was closed): only a process that holds a segment can register it")
        return [_open[label] for label in labels]


def create_segment(label: str, size_bytes: int) -> int:
    """A sealed memfd of `size_bytes` bytes (its descriptor)."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedKVBuffers:
    """Sealed memfd segments an engine (or a test) owns: one per layer slot."""

    def __init__(self, labels: list[str], fds: list[int], sizes: list[int]) -> None:
        self.labels = labels
        self._fds = fds
        self._sizes = sizes
        # populated: the engine allocates its KV cache now, as torch.zeros would, so that the server's
        # registration maps allocated pages in milliseconds instead of allocating them itself
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._maps = [mmap.mmap(fd, size, flags=flags) for fd, size in zip(fds, sizes, strict=True)]
        self.arrays: list[npt.NDArray[np.uint8]] = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        with _open_lock:
            _open.update(zip(labels, fds, strict=True))

    @classmethod
    def create(cls, *, num_buffers: int, size_bytes: int) -> SharedKVBuffers:
        prefix = f"hybridkv-{os.getpid()}-{secrets.token_hex(6)}"
        labels, fds = [], []
        try:
            for j in range(num_buffers):
                labels.append(f"{prefix}-{j}")
                fds.append(create_segment(labels[-1], size_bytes))
            return cls(labels, fds, [size_bytes] * num_buffers)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    @property
    def fds(self) -> list[int]:
        return list(self._fds)

    def buffer_layouts(self) -> list[BufferLayout]:
        return [BufferLayout(shm_name=label, size_bytes=size) for label, size in zip(self.labels, self._sizes,
                                                                                      strict=True)]

    def close(self) -> None:
        """Close every segment (the server keeps its own mapping until it unregisters). A segment still
        viewed by an array or tensor elsewhere stays mapped until that view is gone."""
        self.arrays.clear()
        with _open_lock:
            for label in self.labels:
                _open.pop(label, None)
        for m in self._maps:
            with contextlib.suppress(BufferError):  # views still alive: the mapping goes with the last one
                m.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._maps.clear()
        self._fds.clear()
