"""The infinite-cache ideal: the longest prefix of a prompt that some earlier sequence shares.

An infinite cache keeps every token any earlier request computed, at token granularity (no
block floor, no window, no checkpoint rule, no eviction). The simulator adds each request's
prompt when it arrives and its whole sequence when it finishes, and asks `longest_prefix` when a
request arrives; the ideal hit is that, capped at the prompt's length minus one (the last token
is always computed). Sequences are kept sorted, so the longest shared prefix is with one of the
two neighbours of the query's sorted position.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class IdealCache:
    """Every sequence seen so far, per cache salt (salted prompts share nothing across salts)."""

    def __init__(self) -> None:
        self._sorted: dict[str | None, list[tuple[int, ...]]] = {}

    def add(self, tokens: Sequence[int], *, salt: str | None = None) -> None:
        seqs = self._sorted.setdefault(salt, [])
        key = tuple(tokens)
        at = bisect.bisect_left(seqs, key)
        if at < len(seqs) and seqs[at][: len(key)] == key:
            return  # a prefix of a sequence already kept adds nothing
        if at > 0 and key[: len(seqs[at - 1])] == seqs[at - 1]:
            seqs[at - 1] = key  # extends the neighbour: keep the longer one only
            return
        seqs.insert(at, key)

    def longest_prefix(self, tokens: Sequence[int], *, salt: str | None = None) -> int:
        seqs = self._sorted.get(salt)
        if not seqs:
            return 0
        key = tuple(tokens)
        at = bisect.bisect_left(seqs, key)
        return max((common_prefix(key, seqs[i]) for i in (at - 1, at) if 0 <= i < len(seqs)), default=0)

    def distinct_tokens(self) -> int:
        """Tokens of every sequence kept, each shared prefix counted once (the prefix tree's size)."""
        total = 0
        for seqs in self._sorted.values():
            previous: tuple[int, ...] = ()
            for seq in seqs:
                total += len(seq) - common_prefix(previous, seq)
                previous = seq
        return total
