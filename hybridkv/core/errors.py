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
