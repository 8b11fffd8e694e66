"""Hit tokens of the KV cache server's L1 eviction policies on seeded traces of hybrid layouts.

Each request of a trace (hybridkv/simulate/generators.py) is replayed through the connector's client
against an in-process server: a lookup of its prompt (the hit counted, then released), then the stores
an engine makes: the prompt's chunks from the hit on in one prefill step (the step ends on the last
chunk boundary, so a state group saves only that chunk's state) and each chunk its decode completes
(a state saved at each). The L1 holds a fraction (--l1-fraction) of the bytes the trace stores with no
eviction. Counts, not times: the figures do not depend on the machine's load.

Layouts (one layer per group, page bytes in the ratio of the real models' bytes per chunk):
- qwen3_5: full attention + a Gated DeltaNet state (Qwen3.5-27B: 16 full layers; 48 state layers
  whose state is ~9x a full chunk's attention at 256-token chunks)
- gemma3: full attention + sliding window of 4 chunks (Gemma-3-27B: 10 full, 52 sliding layers)

Prints per layout and generator the hit tokens of each policy (and with no eviction), then last
`server_hits_resumable_vs_lru=<total resumable / total lru> worst=<lowest per-trace ratio>`.
"""

from __future__ import annotations

import argparse
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hybridkv.cache_server.auth import Authenticator
from hybridkv.cache_server.l1_eviction import EvictionPolicyName
from hybridkv.cache_server.service import ControlServer
from hybridkv.cache_server.store import KVStore, StoreConfig
from hybridkv.connector.client import KVClient, SharedKVBuffers, chunk_hashes, make_layout
from hybridkv.simulate.generators import Generator, GeneratorOptions, generate
from hybridkv.simulate.trace import TraceRequest
from hybridkv.wire import GroupKind, GroupLayout

CHUNK = 16  # tokens per chunk (= every group's block): the trace's prompts are scaled to match
UNIT = 64  # bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    name: str
    groups: tuple[GroupLayout, ...]


SHAPES = (
    Shape(name="qwen3_5", groups=(
        GroupLayout(kind=GroupKind.FULL, num_layers=1, block_tokens=CHUNK, page_bytes=16 * UNIT),
        GroupLayout(kind=GroupKind.STATE, num_layers=1, block_tokens=CHUNK, page_bytes=144 * UNIT))),
    Shape(name="gemma3", groups=(
        GroupLayout(kind=GroupKind.FULL, num_layers=1, block_tokens=CHUNK, page_bytes=10 * UNIT),
        GroupLayout(kind=GroupKind.SLIDING, num_layers=1, block_tokens=CHUNK, page_bytes=52 * UNIT,
                    window_tokens=4 * CHUNK + 1))),
)


def sequences(trace: list[TraceRequest], seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, prompt + output) token ids of each request (outputs drawn from a seeded generator)."""
    rng = random.Random(seed)
    out: list[tuple[list[int], list[int]]] = []
    for r in trace:
        prompt = (out[r.parent][1] if r.parent is not None else []) + list(r.new_tokens)
        out.append((prompt, prompt + [rng.randrange(1, 32_000) for _ in range(r.output_tokens)]))
    return out


@contextmanager
def in_process_server(policy: EvictionPolicyName, l1_bytes: int) -> Iterator[str]:
    store = KVStore(StoreConfig(chunk_tokens=CHUNK, l1_bytes=l1_bytes, eviction_policy=policy))
    control = ControlServer(store, "127.0.0.1", 0, 64 << 20, auth=Authenticator(""))
    thread = threading.Thread(target=control.serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{control.port}"
    finally:
        control.stop()
        thread.join(10)
        store.close()


def replay(shape: Shape, seqs: list[tuple[list[int], list[int]]], policy: EvictionPolicyName,
           l1_bytes: int) -> tuple[int, int, int]:
    """(hit tokens, L1 bytes used, L1 dead bytes) after replaying every request."""
    num_blocks = 2 + max(len(full) for _, full in seqs) // CHUNK
    stride = max(g.page_bytes for g in shape.groups)
    buffers = SharedKVBuffers.create(num_buffers=1, size_bytes=num_blocks * stride)
    layout = make_layout(model=shape.name, groups=list(shape.groups), buffers=buffers,
                         num_blocks=num_blocks, page_stride_bytes=stride)
    state = [g.kind is GroupKind.STATE for g in shape.groups]
    hits = 0
    try:
        with in_process_server(policy, l1_bytes) as endpoint, KVClient(endpoint, timeout_s=60) as client:
            client.register(layout)
            for prompt, full in seqs:
                chain = chunk_hashes(full, CHUNK)
                found = client.lookup(chain[:len(prompt) // CHUNK], num_tokens=len(prompt))
                hits += found.hit_tokens
                if found.lookup_id:
                    client.release(found.lookup_id)
                first, prefill_end = found.hit_tokens // CHUNK, len(prompt) // CHUNK
                steps = [(first, prefill_end)] + [(j, j + 1) for j in range(max(first, prefill_end), len(chain))]
                for lo, hi in steps:
                    if hi <= lo:
                        continue
                    ids = [[j + 1 if not s or j == hi - 1 else 0 for j in range(lo, hi)] for s in state]
                    client.store(first_chunk=lo, chunk_hashes=chain[lo:hi], block_ids=ids,
                                 parent_hash=chain[lo - 1] if lo else b"")
            tier = client.status()["tiers"][0]
    finally:
        buffers.close()
    return hits, int(tier["bytes_used"]), int(tier["dead_bytes"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=256, help="generators' mean prompt length")
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--l1-fraction", type=float, default=0.25, help="L1 size / bytes stored with no eviction")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a CI smoke run (30 requests)")
    args = p.parse_args()
    if args.quick:
        args.requests = 30
    totals = {EvictionPolicyName.LRU: 0, EvictionPolicyName.RESUMABLE: 0}
    ratios: list[float] = []
    for shape in SHAPES:
        for kind in Generator:
            trace = generate(kind, GeneratorOptions(num_requests=args.requests, seed=args.seed,
                                                    mean_prompt_tokens=args.prompt_tokens,
                                                    mean_output_tokens=args.output_tokens))
            seqs = sequences(trace, args.seed)
            bound = sum(len(full) // CHUNK for _, full in seqs) * sum(g.page_bytes for g in shape.groups) + (1 << 16)
            ideal, stored, _ = replay(shape, seqs, EvictionPolicyName.LRU, bound)  # room for everything
            l1 = max(1 << 12, int(stored * args.l1_fraction))
            row = {}
            for policy in totals:
                row[policy] = replay(shape, seqs, policy, l1)
                totals[policy] += row[policy][0]
            lru, res = row[EvictionPolicyName.LRU], row[EvictionPolicyName.RESUMABLE]
            ratios.append(res[0] / lru[0] if lru[0] else float(res[0] > 0) + 1.0)
            print(f"{shape.name} {kind.value}: l1={l1} B ({args.l1_fraction:.0%} of {stored}) hit tokens "
                  f"lru={lru[0]} resumable={res[0]} no_eviction={ideal}; dead bytes lru={lru[2]} "
                  f"resumable={res[2]}", flush=True)
    lru_total, res_total = totals[EvictionPolicyName.LRU], totals[EvictionPolicyName.RESUMABLE]
    print(f"server_hits_resumable_vs_lru={res_total / max(1, lru_total):.3f} worst={min(ratios):.3f}")


if __name__ == "__main__":
    main()
