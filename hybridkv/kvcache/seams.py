"""What the mechanism (coordinator, copy on write) calls the cache policies through: protocols only.

The policies in `policies/` implement them (`headroom.AdmissionReserve`, `adoption.StateAdoption`);
the mechanism is built with an implementation or None (the policy is off) and never imports a
policy module. The eviction order and the value marks have theirs in `eviction.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Reserve(Protocol):
    """Blocks a new request's first allocation must leave free (`--admission-headroom`)."""

    def blocks(self, hits: Sequence[Sequence[int]] | None, running: int) -> int:
        """For a request whose hit is `hits` joining `running` requests."""
        ...

    def new_step(self) -> None: ...


class Adoption(Protocol):
    """Whether a state hit may be moved into the new request's running state (`--running-state adopt`)."""

    adoptions: int

    def allows(self, blocks: Sequence[int]) -> bool: ...

    def new_step(self) -> None: ...
