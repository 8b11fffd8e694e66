"""The L1 eviction-policy seam: which unlocked object goes first when the pool needs room.

A policy only orders keys; the pool decides what is evictable (unlocked) and what is removed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from enum import Enum
from typing import Protocol

from hybridkv.errors import ConfigError


class EvictionPolicyName(Enum):
    LRU = "lru"


class EvictionPolicy(Protocol):
    def insert(self, key: bytes) -> None:
        """A new object entered the pool."""
        ...

    def touch(self, key: bytes) -> None:
        """The object was used (stored again, looked up, retrieved)."""
        ...

    def remove(self, key: bytes) -> None:
        ...

    def order(self) -> Iterator[bytes]:
        """Every key, first-to-evict first."""
        ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._keys[key] = None

    def touch(self, key: bytes) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def order(self) -> Iterator[bytes]:
        return iter(self._keys)


def make_policy(name: EvictionPolicyName | str) -> EvictionPolicy:
    try:
        name = EvictionPolicyName(name)
    except ValueError:
        raise ConfigError(f"unknown eviction policy {name!r}; expected one of "
                          f"{[p.value for p in EvictionPolicyName]}") from None
    return LRUPolicy()
