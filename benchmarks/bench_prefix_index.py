#!/usr/bin/env python
"""The cache server's prefix index storing one long chain: cost per chunk as the chain grows.

A store of n new chunks, each naming its parent, places n objects per object group in the index
(`hybridkv/cache_server/prefix_index.py`), then evicts them oldest first, as L1's LRU would. Two
layouts: full attention (every chunk ends a resumable prefix) and full attention + a state saved
at the chain's end (the prefix becomes resumable at the last object, and every chunk at once).
Linear bookkeeping costs the same per chunk at every length; the old one counted each new
prefix in every ancestor (O(n^2) per chain). Prints one line per (layout, n) and last:

    chain_chunks=<largest n> store_s=<its store> evict_s=<its eviction> us_per_chunk=<both, per chunk>
    growth=<us per chunk at the largest n / at the smallest, the worse layout: 1 is linear, n_max / n_min
    quadratic> (figures of the largest n: the full-attention layout)

    .venv/bin/python benchmarks/bench_prefix_index.py [--quick] [--max-chunks 65536]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv.cache_server.prefix_index import ObjectPlace, PrefixIndex


@dataclass(frozen=True)
class Rules:
    """Object group 0 is full attention; group 1, when there, a state (needs only the last chunk)."""

    with_state: bool
    tree_id: bytes = b"bench"

    @property
    def num_object_groups(self) -> int:
        return 2 if self.with_state else 1

    @property
    def state_object_groups(self) -> frozenset[int]:
        return frozenset({1}) if self.with_state else frozenset()

    @property
    def full_object_groups(self) -> frozenset[int]:
        return frozenset({0})

    def first_needed(self, object_group: int, hit_chunks: int) -> int:
        return 0 if object_group == 0 else hit_chunks - 1

    def empty(self, object_group: int, chunk: int) -> bool:
        return False


def chunk_hash(chunk: int) -> bytes:
    return chunk.to_bytes(16, "little")


def run_chain(rules: Rules, n: int) -> tuple[float, float]:
    """(seconds to place the chain, seconds to evict it oldest first)."""
    index = PrefixIndex()
    keys = []
    t0 = time.perf_counter()
    for c in range(n):
        groups = (0, 1) if rules.with_state and c == n - 1 else (0,)
        for o in groups:
            key = chunk_hash(c) + bytes([o])
            keys.append(key)
            index.insert(key, 4096, ObjectPlace(rules=rules, chunk=c, chunk_hash=chunk_hash(c),
                                                parent_hash=chunk_hash(c - 1) if c else None, object_group=o))
    placed_s = time.perf_counter() - t0
    expected = n if not rules.with_state else 1
    if index.stats().resumable_prefixes != expected:
        raise SystemExit(f"{index.stats().resumable_prefixes} resumable prefixes after the chain, expected {expected}")
    t0 = time.perf_counter()
    for key in keys:
        index.remove(key)
    evicted_s = time.perf_counter() - t0
    if index.stats().trees:
        raise SystemExit(f"{index.stats().trees} trees left after evicting every object")
    return placed_s, evicted_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-chunks", type=int, default=65536)
    ap.add_argument("--quick", action="store_true", help="chains up to 4,096 chunks")
    args = ap.parse_args()
    top = 4096 if args.quick else args.max_chunks
    sizes = [n for n in (1024, 4096, 16384, 65536, 262144) if n <= top]
    if not sizes:
        raise SystemExit(f"--max-chunks must be at least 1024, got {top}")
    growth, last = 0.0, (0, 0.0, 0.0)
    for with_state in (False, True):
        rules = Rules(with_state=with_state)
        per_chunk = []
        for n in sizes:
            placed_s, evicted_s = run_chain(rules, n)
            per_chunk.append((placed_s + evicted_s) / n * 1e6)
            print(f"layout={'full+state' if with_state else 'full'} chunks={n} store_s={placed_s:.3f} "
                  f"evict_s={evicted_s:.3f} us_per_chunk={per_chunk[-1]:.2f}", flush=True)
            if not with_state:
                last = (n, placed_s, evicted_s)
        growth = max(growth, per_chunk[-1] / per_chunk[0])
    n, placed_s, evicted_s = last
    print(f"chain_chunks={n} store_s={placed_s:.3f} evict_s={evicted_s:.3f} "
          f"us_per_chunk={(placed_s + evicted_s) / n * 1e6:.2f} growth={growth:.2f}")


if __name__ == "__main__":
    main()
