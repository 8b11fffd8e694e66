"""Seeded request traces for the manager benchmark.

`make_trace(n, seed)`: 64 shared prefixes of 256..2048 tokens drawn with Zipf-like weights;
80% of the n prompts start with one (cut to leave at least one suffix token), the rest are
unique. Each entry is (prompt token ids, decode steps). The body is fixed: changing it changes
every published benchmark number.
"""

from __future__ import annotations

import random

Trace = list[tuple[list[int], int]]


def make_trace(n: int, seed: int) -> Trace:
    rng = random.Random(seed)
    prefixes = []
    for _ in range(64):
        plen = rng.randint(256, 2048)
        prefixes.append([rng.randrange(1, 150000) for _ in range(plen)])
    weights = [1.0 / (i + 1) for i in range(64)]
    trace = []
    for _ in range(n):
        total = rng.randint(512, 4096)
        if rng.random() < 0.8:
            pre = rng.choices(prefixes, weights)[0]
            pre = pre[: min(len(pre), total - 1)]
        else:
            pre = []
        suffix = [rng.randrange(1, 150000) for _ in range(total - len(pre))]
        trace.append((pre + suffix, rng.randint(2, 8)))  # (prompt tokens, decode steps)
    return trace
