"""Hit tokens of the KV cache server's L1 eviction policies and L2 sizing on seeded traces of hybrid layouts.

Each request of a trace (hybridkv/simulate/generators.py) is replayed through the connector's client
against an in-process server: a lookup of its prompt (the hit counted, then released), then the stores
an engine makes: the prompt's chunks from the hit on in one prefill step (the step ends on the last
chunk boundary, so a state group saves only that chunk's state) and each chunk its decode completes
(a state saved at each). The L1 holds a fraction (--l1-fraction) of the bytes the trace stores with no
eviction. Counts, not times: the figures do not depend on the machine's load (the write-behind is
flushed after each request, so a lookup sees every earlier write).

The L2 runs split the same total (--l1-fraction) into an L1 (--l2-l1-fraction, policy `lru`) and a
disk tier (the rest), and compare the tier bounding itself object by object (`--l2-sizing objects`)
with the server sizing it by resumable prefixes (`--l2-sizing resumable`), summed over --l2-seeds
seeds per layout and generator.

Layouts (one layer per group, page bytes in the ratio of the real models' bytes per chunk):
- qwen3_5: full attention + a Gated DeltaNet state (Qwen3.5-27B: 16 full layers; 48 state layers
  whose state is ~9x a full chunk's attention at 256-token chunks)
- gemma3: full attention + sliding window of 4 chunks (Gemma-3-27B: 10 full, 52 sliding layers)

Prints per layout and generator the hit tokens of each L1 policy (and with no eviction), then of each
L2 sizing, then `server_hits_resumable_vs_lru=<total resumable / total lru> worst=<lowest per-trace
ratio>` and last `server_hits_l2_sized_vs_unsized=<total sized / total unsized> worst=<lowest ratio>`.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hybridkv.cache_server.auth import Authenticator
from hybridkv.cache_server.l1_eviction import L1EvictionPolicyName
from hybridkv.cache_server.l2_sizing import L2Sizing
from hybridkv.cache_server.service import ControlServer
from hybridkv.cache_server.store import KVStore, StoreConfig
from hybridkv.cache_server.tiers.disk import DiskTier
from hybridkv.connector.client import KVClient, SharedKVBuffers, chunk_hashes, make_layout
from hybridkv.simulate.generators import SHORT, Generator, GeneratorOptions, generate
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    policy: L1EvictionPolicyName
    l1_bytes: int
    disk_bytes: int = 0  # 0: no L2 tier
    l2_sizing: L2Sizing = L2Sizing.OBJECTS


@contextmanager
def in_process_server(setup: Setup) -> Iterator[tuple[str, KVStore]]:
    shm = Path("/dev/shm")  # memory-backed where there is one: the figures are counts, the files only slow it
    with tempfile.TemporaryDirectory(prefix="bench-server-hits-", dir=shm if shm.is_dir() else None) as tmp:
        tiers = [DiskTier(Path(tmp), setup.disk_bytes)] if setup.disk_bytes else []
        store = KVStore(StoreConfig(chunk_tokens=CHUNK, l1_bytes=setup.l1_bytes, eviction_policy=setup.policy,
                                    l2_sizing=setup.l2_sizing), tiers)
        with _serving(store) as endpoint:
            yield endpoint, store


@contextmanager
def _serving(store: KVStore) -> Iterator[str]:
    control = ControlServer(store, "127.0.0.1", 0, 64 << 20, auth=Authenticator(""))
    thread = threading.Thread(target=control.serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{control.port}"
    finally:
        control.stop()
        thread.join(10)
        store.close()


def replay(shape: Shape, seqs: list[tuple[list[int], list[int]]], setup: Setup) -> tuple[int, int, int]:
    """(hit tokens, L1 bytes used, L1 dead bytes) after replaying every request."""
    num_blocks = 2 + max(len(full) for _, full in seqs) // CHUNK
    stride = max(g.page_bytes for g in shape.groups)
    buffers = SharedKVBuffers.create(num_buffers=1, size_bytes=num_blocks * stride)
    layout = make_layout(model=shape.name, groups=list(shape.groups), buffers=buffers,
                         num_blocks=num_blocks, page_stride_bytes=stride)
    state = [g.kind is GroupKind.STATE for g in shape.groups]
    hits = 0
    try:
        with in_process_server(setup) as (endpoint, store), KVClient(endpoint, timeout_s=60) as client:
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
                store.tiers.flush(timeout_s=60)  # the next lookup sees every write: counts do not depend on timing
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
    p.add_argument("--l2-l1-fraction", type=float, default=0.10,
                   help="in the L2 runs, L1's share of the same total; the disk tier gets the rest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l2-seeds", type=int, default=3, help="the L2 runs replay seeds --seed.. --seed + N - 1 "
                   "(one trace's hits move with small changes of what a tier keeps)")
    p.add_argument("--quick", action="store_true", help="a CI smoke run (30 requests)")
    args = p.parse_args()
    if args.quick:
        args.requests = 30
    if args.quick:
        args.l2_seeds = 1
    if not 0 < args.l2_l1_fraction < args.l1_fraction:
        p.error(f"--l2-l1-fraction must be in (0, --l1-fraction {args.l1_fraction}), got {args.l2_l1_fraction}")
    l1_runs: list[tuple[int, int]] = []  # (lru, resumable) hit tokens per trace
    l2_runs: list[tuple[int, int]] = []  # (unsized, sized) hit tokens per trace
    for shape in SHAPES:
        for kind in SHORT:  # (the four short workloads its figures were measured on)
            seqs, stored, ideal = trace_of(shape, kind, args, args.seed)
            l1_runs.append(l1_row(shape, kind, seqs, stored, ideal, args.l1_fraction))
    for shape in SHAPES:
        for kind in SHORT:  # (the four short workloads its figures were measured on)
            runs = [l2_run(shape, *trace_of(shape, kind, args, seed)[:2], args.l1_fraction, args.l2_l1_fraction)
                    for seed in range(args.seed, args.seed + args.l2_seeds)]
            l2_runs.append((sum(u for u, _ in runs), sum(z for _, z in runs)))
            print(f"l2 {shape.name} {kind.value}: l1 {args.l2_l1_fraction:.0%} + disk "
                  f"{args.l1_fraction - args.l2_l1_fraction:.0%} of what the trace stores, hit tokens over seeds "
                  f"{args.seed}..{args.seed + args.l2_seeds - 1} unsized={l2_runs[-1][0]} sized={l2_runs[-1][1]} "
                  f"(per seed {' '.join(f'{u}/{z}' for u, z in runs)})", flush=True)
    print(summary("server_hits_resumable_vs_lru", l1_runs))
    print(summary("server_hits_l2_sized_vs_unsized", l2_runs))


def l1_row(shape: Shape, kind: Generator, seqs: list[tuple[list[int], list[int]]], stored: int, ideal: int,
           fraction: float) -> tuple[int, int]:
    """L1 only, at `fraction` of what the trace stores: hits of `lru` and `resumable`."""
    l1 = max(1 << 12, int(stored * fraction))
    lru = replay(shape, seqs, Setup(policy=L1EvictionPolicyName.LRU, l1_bytes=l1))
    res = replay(shape, seqs, Setup(policy=L1EvictionPolicyName.RESUMABLE, l1_bytes=l1))
    print(f"{shape.name} {kind.value}: l1={l1} B ({fraction:.0%} of {stored}) hit tokens lru={lru[0]} "
          f"resumable={res[0]} no_eviction={ideal}; dead bytes lru={lru[2]} resumable={res[2]}", flush=True)
    return lru[0], res[0]


def trace_of(shape: Shape, kind: Generator, args: argparse.Namespace,
             seed: int) -> tuple[list[tuple[list[int], list[int]]], int, int]:
    """(sequences, bytes the trace stores with no eviction, hit tokens then)."""
    options = GeneratorOptions(num_requests=args.requests, seed=seed, mean_prompt_tokens=args.prompt_tokens,
                               mean_output_tokens=args.output_tokens)
    trace = generate(kind, options)
    seqs = sequences(trace, seed)
    bound = sum(len(full) // CHUNK for _, full in seqs) * sum(g.page_bytes for g in shape.groups) + (1 << 16)
    ideal, stored, _ = replay(shape, seqs, Setup(policy=L1EvictionPolicyName.LRU, l1_bytes=bound))
    return seqs, stored, ideal


def l2_run(shape: Shape, seqs: list[tuple[list[int], list[int]]], stored: int, total: float,
           l1_share: float) -> tuple[int, int]:
    """The same total bytes split into an L1 (`lru`) and a disk tier: hits with the tier bounding itself
    (`--l2-sizing objects`) and sized by resumable prefixes (`resumable`)."""
    l1 = max(1 << 12, int(stored * l1_share))
    disk = max(1 << 12, int(stored * (total - l1_share)))
    unsized, sized = (replay(shape, seqs, Setup(policy=L1EvictionPolicyName.LRU, l1_bytes=l1, disk_bytes=disk,
                                                l2_sizing=sizing))[0]
                      for sizing in (L2Sizing.OBJECTS, L2Sizing.RESUMABLE))
    return unsized, sized


def summary(name: str, runs: list[tuple[int, int]]) -> str:
    """`name=<total new / total old> worst=<lowest per-trace ratio>` (a trace with no old hits: 1, or 2 if new hit)."""
    ratios = [new / old if old else float(new > 0) + 1.0 for old, new in runs]
    return f"{name}={sum(n for _, n in runs) / max(1, sum(o for o, _ in runs)):.3f} worst={min(ratios):.3f}"


if __name__ == "__main__":
    main()
