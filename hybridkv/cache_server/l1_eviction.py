"""The L1 eviction-policy seam: which unlocked object goes first when the pool needs room.

A policy only orders keys; the pool decides what is evictable (unlocked) and what is removed.

- `lru`: least recently used object first, each object on its own (an attention chunk may stay
  while the state that makes it a hit is gone).
- `resumable`: dead objects first (no resumable prefix needs them: prefix_index.py), then, in a
  state layout, the least recently used resumable prefix as a unit, the objects only it needs, tail
  first (its state, then its own attention chain back to where another prefix shares it), then
  whatever is left, least recently used first (a full + window layout has no units: its objects
  go least recently used first once the dead ones are gone).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from enum import Enum
from typing import Protocol

from hybridkv.cache_server.prefix_index import PrefixIndex
from hybridkv.errors import ConfigError


class L1EvictionPolicyName(Enum):
    LRU = "lru"
    RESUMABLE = "resumable"


class L1EvictionPolicy(Protocol):
    def insert(self, key: bytes) -> None:
        """A new object entered the pool."""
        ...

    def touch(self, key: bytes) -> None:
        """The object was used (stored again, looked up, retrieved)."""
        ...

    def remove(self, key: bytes) -> None:
        ...

    def order(self) -> Iterator[bytes]:
        """Every key, first-to-evict first (the pool stops iterating once it removes one)."""
        ...


class L1LRUPolicy:
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


class L1ResumablePolicy(L1LRUPolicy):
    """Dead objects, then resumable prefixes as units (least recently used first), then LRU."""

    def __init__(self, index: PrefixIndex) -> None:
        super().__init__()
        self._index = index

    def order(self) -> Iterator[bytes]:
        seen: set[bytes] = set()
        for key in self._index.dead_keys():
            seen.add(key)
            yield key
        for key in self._index.unit_keys():
            if key not in seen:
                seen.add(key)
                yield key
        for key in self._keys:
            if key not in seen:
                yield key


def make_policy(name: L1EvictionPolicyName | str, index: PrefixIndex) -> L1EvictionPolicy:
    """The policy called `name`; `index` is the pool's prefix index (read by `resumable`)."""
    try:
        name = L1EvictionPolicyName(name)
    except ValueError:
        raise ConfigError(f"unknown eviction policy {name!r}; expected one of "
                          f"{[p.value for p in L1EvictionPolicyName]}") from None
    if name is L1EvictionPolicyName.RESUMABLE:
        return L1ResumablePolicy(index)
    return L1LRUPolicy()
