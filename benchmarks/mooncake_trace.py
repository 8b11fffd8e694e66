"""A small seeded trace in the Mooncake format (FAST'25): one JSON object per line with `timestamp`
(ms), `input_length`, `output_length` and `hash_ids` (one id per 512-token block; equal ids = equal
content, the last block may be partial).

Shape, as the public Mooncake traces: a few popular shared prefixes (system prompts / documents,
Zipf-like popularity) of 2..8 blocks; about half of the requests continue an earlier request's
ids (a later turn, which repeats the earlier prompt's blocks and adds new ones); the rest start
from a shared prefix and add their own blocks.

    .venv/bin/python benchmarks/mooncake_trace.py --seed 0 --num-requests 100 > trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BLOCK_TOKENS = 512


def records(*, seed: int, num_requests: int = 100, gap_ms: float = 100.0) -> list[dict[str, object]]:
    """The trace's records, in arrival order."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prefixes = [fresh(rng.randint(2, 8)) for _ in range(6)]
    weights = [1 / (i + 1) for i in range(len(prefixes))]
    out: list[dict[str, object]] = []
    clock = 0.0
    for _ in range(num_requests):
        clock += rng.expovariate(1 / gap_ms)
        if out and rng.random() < 0.5:
            parent = rng.choice(out[-20:])
            ids = list(parent["hash_ids"])[:-1] + fresh(rng.randint(1, 3))  # type: ignore[call-overload]
        else:
            ids = rng.choices(prefixes, weights)[0] + fresh(rng.randint(1, 4))
        partial = rng.randint(1, BLOCK_TOKENS)
        out.append({"timestamp": int(clock), "input_length": (len(ids) - 1) * BLOCK_TOKENS + partial,
                    "output_length": rng.randint(16, 256), "hash_ids": ids})
    return out


def write(path: Path, *, seed: int, num_requests: int = 100) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records(seed=seed, num_requests=num_requests)))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description="a seeded Mooncake-format trace on stdout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=100)
    args = parser.parse_args()
    for record in records(seed=args.seed, num_requests=args.num_requests):
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
