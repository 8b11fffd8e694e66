"""The hybridkv error hierarchy.

Every error a user can cause is a `HybridKVError`. Subclasses also derive from the builtin
exception that fits (`ValueError`, `KeyError`) so callers that already catch those keep working.
Messages say what was wrong, what was received and what was expected.
"""

from __future__ import annotations


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on bad input or impossible requests."""


class ConfigError(HybridKVError, ValueError):
    """A model config.json or an option is missing a field, has a bad value or is unsupported."""


class UnsupportedModelError(HybridKVError, KeyError):
    """The model type or architecture is not in a registry; the message lists the supported ones."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class CapacityError(HybridKVError, ValueError):
    """A memory budget is too small to hold even one request, or a request can never fit."""


class AllocationError(HybridKVError, ValueError):
    """A KV cache manager call contradicts the request's state (negative counts, slots beyond
    `max_model_len`, a cache hit for a request that already holds blocks, ...)."""


class StaleHitError(AllocationError):
    """A `CacheHit` refers to blocks that were evicted (or reset) after the lookup."""


class UnknownRequestError(HybridKVError, KeyError):
    """The request holds no blocks in the KV cache manager."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class IntegrityError(HybridKVError, RuntimeError):
    """An internal invariant of the block pool or the managers is broken (a bug, not bad input).

    Raised by `check_integrity()` with the actual numbers."""
