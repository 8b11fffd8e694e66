"""The local-disk L2 tier: one file per object, an in-memory index rebuilt from the directory.

    DIR/.lock                 flock held while a DiskTier has DIR open (one process per directory)
    DIR/tmp/<random>.tmp      an object being written; leftovers from a killed writer are removed
    DIR/objects/ab/<hash>.kvo one framed object (framing.py), named by blake2b-128 of its key

Nobody else reads or plants objects here: directories are 0700 and files 0600 whatever the umask;
an object is opened with O_NOFOLLOW | O_NONBLOCK and fstat'ed before any read (a regular file of
this user whose size is the header's claim and the size indexed), so a symlink, FIFO, directory or
sparse giant where an object should be is dropped, never followed, waited on or read. At start-up
such stray entries are skipped, counted and reported in one warning (never fatal); a clear that
cannot delete a file says how many remain.

A put writes the whole frame to a temporary file and renames it into place, so after a crash
(kill -9 included) a name holds either a complete older object or a complete newer one, never part
of one. The index lives in memory, ordered least recently used first; on start it is rebuilt by
reading each file's header (a file whose size disagrees with its header is dropped and counted),
ordered by modification time, which a hit refreshes. Checksums are checked on every get: a corrupt
file is deleted, counted and reported as absent. No fsync: a power loss may lose recent objects,
but what a process crash leaves is whole.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import stat as stat_mod
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hybridkv.cache_server.tiers import framing
from hybridkv.cache_server.tiers.base import TierError, TierStats, TierWatcher

log = logging.getLogger(__name__)

_SUFFIX = ".kvo"


@dataclass(slots=True, eq=False)
class _Entry:
    """One indexed file. Compared by identity: a newer put of the key makes a new entry, which
    tells a reader whether the file it found damaged is still the indexed one."""

    path: Path
    size_bytes: int


class _NotAnObject(Exception):
    """What an object path names is not a regular file of this user of the expected size."""


def _private_dir(path: Path) -> None:
    """`path` as a directory of ours, 0700 (created so; an existing one is tightened): TierError when it
    is a symlink or another user's."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat_mod.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise TierError(f"disk tier: {path} must be a directory of uid {os.geteuid()} (found "
                        f"{stat_mod.filemode(st.st_mode)}, uid {st.st_uid}); give the tier a directory of its own")
    if stat_mod.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _open_object(path: Path, size_bytes: int | None) -> BinaryIO:
    """`path` opened for reading without following a symlink or waiting on a FIFO, once it is known
    to be a regular file of this user (of `size_bytes`, when given); _NotAnObject otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise _NotAnObject(f"{path} is not a regular file of uid {os.geteuid()}")
        if size_bytes is not None and st.st_size != size_bytes:
            raise _NotAnObject(f"{path} has {st.st_size} bytes, {size_bytes} were written")
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class DiskTier:
    """An `L2Tier` in `directory`, holding at most `capacity_bytes` of frames (LRU eviction)."""

    name = "disk"
    private = True  # one server per directory (DIR/.lock)

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._objects_dir = self.directory / "objects"
        self._tmp_dir = self.directory / "tmp"
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes_used = 0
        self._errors = 0
        self._corrupt_dropped = 0
        self._evictions = 0
        self._closed = False
        self._last_used_ns = 0
        self._stray = 0  # entries found at start-up that are not objects of ours (skipped)
        self._watcher: TierWatcher | None = None
        try:
            for d in (self.directory, self._objects_dir, self._tmp_dir):
                _private_dir(d)
            self._lock_file = self._take_directory_lock()
            for leftover in self._tmp_dir.iterdir():
                self._unlink(leftover)
            self._rebuild_index()
        except OSError as e:
            raise TierError(f"cannot open disk tier {self.directory}: {e}") from e

    # --- the L2Tier protocol -------------------------------------------------------------------

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        header = framing.encode_header(key, value)
        size = len(header) + (value.nbytes if isinstance(value, memoryview) else len(value))
        if size > self.capacity_bytes:
            raise TierError(f"object of {size} bytes does not fit the disk tier's capacity of "
                            f"{self.capacity_bytes} bytes")
        self._check_open()
        path = self._path(key)
        tmp = self._tmp_dir / f"{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as f:
                os.fchmod(fd, 0o600)  # whatever the umask
                f.write(header)
                f.write(value)
            with self._lock:
                self._make_room(size, replacing=key)
                _private_dir(path.parent)
                os.replace(tmp, path)
                self._forget(key)
                self._index[key] = _Entry(path=path, size_bytes=size)
                self._bytes_used += size
                self._touch(path)
                if self._watcher is not None:
                    self._watcher.written(key)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise self._error(f"disk tier put into {path} failed: {e}") from e

    def get(self, key: bytes) -> bytes | None:
        self._check_open()
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._index.move_to_end(key)
            path = entry.path
        try:
            with _open_object(path, entry.size_bytes) as f:
                value = self._read_frame(f, key)
        except FileNotFoundError:
            self._drop_if_same(key, entry, "file vanished")
            return None
        except (framing.FrameError, _NotAnObject) as e:
            self._drop_if_same(key, entry, str(e))
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink where the object was: never followed
                self._drop_if_same(key, entry, "a symlink replaced the file")
                return None
            raise self._error(f"disk tier get from {path} failed: {e}") from e
        with self._lock, contextlib.suppress(OSError):  # evicted meanwhile: the value is still whole
            self._touch(path)
        return value

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        with self._lock:
            return [k in self._index for k in keys]

    def delete(self, key: bytes) -> None:
        self._check_open()
        with self._lock:
            entry = self._forget(key)
            if entry is not None:
                self._unlink(entry.path)
                self._tell_removed(key)

    def clear(self) -> int:
        """Remove every object; how many files could not be deleted (they stay on disk, out of the
        index: not served by this process, found again after a restart)."""
        self._check_open()
        with self._lock:
            remaining = sum(0 if self._unlink(entry.path) else 1 for entry in self._index.values())
            for key in self._index:
                self._tell_removed(key)
            self._index.clear()
            self._bytes_used = 0
            return remaining

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(name=self.name, objects=len(self._index), bytes_used=self._bytes_used,
                             capacity_bytes=self.capacity_bytes, errors=self._errors,
                             corrupt_dropped=self._corrupt_dropped, evictions=self._evictions)

    @property
    def stray_entries(self) -> int:
        """Entries found at start-up that are not objects of this server (skipped, left in place)."""
        return self._stray

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock_file.close()  # releases the flock

    # --- internals ------------------------------------------------------------------------------

    def _take_directory_lock(self) -> BinaryIO:
        lock_file = open(self.directory / ".lock", "ab")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise TierError(f"disk tier directory {self.directory} is in use by another DiskTier "
                            f"(its .lock is held); give each server its own directory") from None
        return lock_file

    def _candidates(self) -> list[Path]:
        """The object files' paths: entries of real subdirectories (never through a symlink)."""
        paths: list[Path] = []
        for sub in os.scandir(self._objects_dir):
            if not sub.is_dir(follow_symlinks=False):
                self._stray += 1
                continue
            paths.extend(Path(e.path) for e in os.scandir(sub.path) if e.name.endswith(_SUFFIX))
        return paths

    def _rebuild_index(self) -> None:
        found: list[tuple[int, bytes, _Entry]] = []
        skipped_versions = 0
        for path in self._candidates():
            try:
                key, stat = self._read_key(path)
            except framing.FrameVersionError:
                skipped_versions += 1
                continue
            except framing.FrameError as e:
                log.warning("disk tier: dropping %s: %s", path, e)
                self._unlink(path)
                self._corrupt_dropped += 1
                continue
            except (OSError, _NotAnObject):  # a directory, a symlink (loop), a FIFO, another user's file
                self._stray += 1
                continue
            found.append((stat.st_mtime_ns, key, _Entry(path=path, size_bytes=stat.st_size)))
        if self._stray:
            log.warning("disk tier: %d entries in %s are not objects of this server (a directory, symlink, FIFO or "
                        "file of another user where an object should be); skipped, left in place", self._stray,
                        self._objects_dir)
        for mtime_ns, key, entry in sorted(found, key=lambda t: t[0]):
            self._index[key] = entry
            self._bytes_used += entry.size_bytes
            self._last_used_ns = max(self._last_used_ns, mtime_ns)
        if skipped_versions:
            log.warning("disk tier: %d objects of another format version in %s are ignored",
                        skipped_versions, self._objects_dir)
        self._make_room(0, replacing=None)  # the capacity may be smaller than last time

    def _read_key(self, path: Path) -> tuple[bytes, os.stat_result]:
        with _open_object(path, None) as f:
            stat = os.fstat(f.fileno())
            header = framing.decode_header(f.read(framing.HEADER_BYTES))
            key = f.read(header.key_bytes)
        if len(key) != header.key_bytes or stat.st_size != header.frame_bytes:
            raise framing.FrameError(f"file is {stat.st_size} bytes, its header says {header.frame_bytes}")
        if path != self._path(key):
            raise framing.FrameError(f"file holds a key whose name would be {self._path(key).name}")
        return key, stat

    @staticmethod
    def _read_frame(f: BinaryIO, key: bytes) -> bytes:
        size = os.fstat(f.fileno()).st_size
        raw_header = f.read(framing.HEADER_BYTES)
        header = framing.decode_header(raw_header)
        if size != header.frame_bytes:
            raise framing.FrameError(f"file is {size} bytes, its header says {header.frame_bytes}")
        stored_key = f.read(header.key_bytes)
        value = f.read(header.value_bytes)
        if len(value) != header.value_bytes:
            raise framing.FrameError(f"value is {len(value)} bytes, its header says {header.value_bytes}")
        framing.verify(raw_header, stored_key, value, expected_key=key)
        return value

    def _make_room(self, size: int, *, replacing: bytes | None) -> None:
        """Evict least recently used objects until `size` more bytes fit (lock held)."""
        old = self._index.get(replacing) if replacing is not None else None
        freed = old.size_bytes if old is not None else 0
        while self._bytes_used - freed + size > self.capacity_bytes:
            victim = next(k for k in self._index if k != replacing)
            entry = self._index.pop(victim)
            self._bytes_used -= entry.size_bytes
            self._unlink(entry.path)
            self._evictions += 1
            self._tell_removed(victim)

    def watch(self, watcher: TierWatcher) -> str | None:
        """Every object this process puts, evicts, deletes or drops is told to `watcher` (the objects
        found on disk at start-up are not: they were never written by this run)."""
        with self._lock:
            self._watcher = watcher
        return None

    def _tell_removed(self, key: bytes) -> None:
        if self._watcher is not None:
            self._watcher.removed(key)

    def _forget(self, key: bytes) -> _Entry | None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._bytes_used -= entry.size_bytes
        return entry

    def _drop_if_same(self, key: bytes, entry: _Entry, reason: str) -> None:
        """Drop a file found corrupt or missing, unless it was evicted, deleted or replaced by a
        newer put meanwhile (then the index no longer holds `entry`)."""
        with self._lock:
            if self._index.get(key) is not entry:
                return
            log.warning("disk tier: dropping corrupt object %s: %s", entry.path, reason)
            self._forget(key)
            self._unlink(entry.path)
            self._corrupt_dropped += 1
            self._tell_removed(key)

    def _unlink(self, path: Path) -> bool:
        """Remove `path`; whether it is gone."""
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            self._errors += 1
            log.warning("disk tier: cannot remove %s: %s", path, e)
            return False
        return True

    def _touch(self, path: Path) -> None:
        """Stamp `path` as the most recently used file (lock held). The modification time orders
        the index rebuilt after a restart; explicit, strictly increasing nanoseconds because the
        kernel's own file timestamps are only as fine as its clock tick."""
        self._last_used_ns = max(time.time_ns(), self._last_used_ns + 1)
        os.utime(path, ns=(self._last_used_ns, self._last_used_ns))

    def _path(self, key: bytes) -> Path:
        digest = hashlib.blake2b(key, digest_size=16).hexdigest()
        return self._objects_dir / digest[:2] / f"{digest[2:]}{_SUFFIX}"

    def _error(self, message: str) -> TierError:
        with self._lock:
            self._errors += 1
        return TierError(message)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"disk tier {self.directory} is closed")
