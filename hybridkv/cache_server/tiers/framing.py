"""The object format shared by every L2 tier: a versioned, checksummed frame around one value.

    | magic "HKVO" | version u16 | flags u16 | key bytes u32 | value bytes u64 | checksum u64 | key | value |
    <------------------------ HEADER_BYTES = 28 (little endian) ------------------------------->

The checksum is xxh3-64 over the first 20 header bytes, the key and the value, so a flipped bit
anywhere, a truncated value or a frame filed under another key is detected. A reader refuses a
frame of another format version without calling it corrupt (a newer server may share the
medium); `FORMAT_VERSION` changes only with the frame layout, never silently.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"HKVO"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")  # magic, version, flags, key bytes, value bytes
_CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = _PREFIX.size + _CHECKSUM.size


class FrameError(Exception):
    """A frame is corrupt: bad magic, impossible lengths, wrong key or a checksum mismatch."""


class FrameVersionError(FrameError):
    """A well-formed frame of a format version this reader does not know (not corruption)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameHeader:
    key_bytes: int
    value_bytes: int
    checksum: int

    @property
    def frame_bytes(self) -> int:
        return HEADER_BYTES + self.key_bytes + self.value_bytes


def _checksum(prefix: bytes, key: bytes, value: bytes | memoryview) -> int:
    h = xxhash.xxh3_64(prefix)
    h.update(key)
    h.update(value)
    return int(h.intdigest())


def encode_header(key: bytes, value: bytes | memoryview) -> bytes:
    """Header + key: what precedes `value` in the frame."""
    value_bytes = value.nbytes if isinstance(value, memoryview) else len(value)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(key), value_bytes)
    return prefix + _CHECKSUM.pack(_checksum(prefix, key, value)) + key


def encode(key: bytes, value: bytes | memoryview) -> bytes:
    """The whole frame as one bytes object."""
    return b"".join((encode_header(key, value), value))


def decode_header(header: bytes) -> FrameHeader:
    """Parse the fixed `HEADER_BYTES` header; raises FrameError / FrameVersionError."""
    if len(header) < HEADER_BYTES:
        raise FrameError(f"frame header is {len(header)} bytes, expected {HEADER_BYTES}")
    magic, version, _flags, key_bytes, value_bytes = _PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise FrameVersionError(f"format version {version}, this reader knows {FORMAT_VERSION}")
    (checksum,) = _CHECKSUM.unpack_from(header, _PREFIX.size)
    return FrameHeader(key_bytes=key_bytes, value_bytes=value_bytes, checksum=checksum)


def verify(header: bytes, key: bytes, value: bytes | memoryview, *, expected_key: bytes) -> None:
    """Check a frame read in pieces: raises FrameError unless `key` is `expected_key` and the
    checksum over header prefix, key and value matches."""
    parsed = decode_header(header)
    if key != expected_key:
        raise FrameError(f"frame holds key {key[:32]!r}..., expected {expected_key[:32]!r}...")
    got = _checksum(bytes(header[: _PREFIX.size]), key, value)
    if got != parsed.checksum:
        raise FrameError(f"checksum {got:#018x} does not match the stored {parsed.checksum:#018x}")


def decode(frame: bytes, *, expected_key: bytes) -> bytes:
    """The value of a whole frame; raises FrameError / FrameVersionError."""
    header = decode_header(frame[:HEADER_BYTES])
    if len(frame) != header.frame_bytes:
        raise FrameError(f"frame is {len(frame)} bytes, its header says {header.frame_bytes}")
    view = memoryview(frame)
    key = bytes(view[HEADER_BYTES: HEADER_BYTES + header.key_bytes])
    value = view[HEADER_BYTES + header.key_bytes:]
    verify(frame[:HEADER_BYTES], key, value, expected_key=expected_key)
    return bytes(value)
