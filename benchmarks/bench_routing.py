#!/usr/bin/env python
"""Routing by the joint hybrid hit: prediction accuracy, realized hits vs attention-only and round
robin, and the index's scale.

Part 1, per model (the embedded sliding-window Gemma 3, and a tiny random Gated DeltaNet hybrid,
Qwen3.5-style, built as in bench_run_policies.py): 4 `hybridkv serve` engines publishing KV events,
one `hybridkv index`, one `hybridkv route` per policy (joint, attention, round_robin; the engines'
prefix caches reset between policies). Workload (seeded, `workload`): sessions on K long system
prompts (popularity skewed), 2-5 requests each, run closed loop by 4 clients at once (50 ms between a
response and the client's next request); a request is the next turn or, one time in three, a branch
from an earlier turn; 1 new token per request, prompts as token ids. The
KV cache of each engine holds only a few of the system prompts, so where a request goes decides
its hit. `--workload documents`: questions about long documents cut at different sections
(`documents`).

    accuracy   share of routed requests whose `cached_tokens` equals the index's `longest_matched`
               (the router asks again while the index is behind the KV events an engine's responses
               already counted: `x-hybridkv-kv-events-seq`, docs/routing.md)
    hit        realized prefix-hit tokens (sum of `cached_tokens`) per policy
    balance    max / min requests per engine
    missed_concurrent  mispredicted requests that overlapped another request on the same engine
    accuracy_isolated  the accuracy over the requests that overlapped no other request on their engine
                       (the index's own error, without the same-engine races it cannot see)
    ideal      the hit tokens of one engine with an unbounded cache and a usable point at every step
               of the engines' hit granularity (`ideal_hits`): a ceiling for any router

Part 2 (in-process): 1M indexed blocks over 4 instances; ingest rate (msgpack decode + apply);
memory per indexed block (tracemalloc); a 32k-token prompt held to its end by one instance: `/query`
p50/p99 in process (token ids as a Python list) and over HTTP from a client in another process over
one kept-alive connection, with the server's CPU time per request (what the latency would be on an
idle core), and `/query_by_hash` in process (the router hashed the prompt); the 1-minute load average
beside them.

Last line: accuracy=... accuracy_isolated=... joint_vs_attention_gdn=... joint_vs_rr_gdn=... ideal_vs_rr_gdn=...
joint_vs_attention_swa=... joint_vs_rr_swa=... ideal_vs_rr_swa=... balance_max=... query_p99_ms=...
query_by_hash_p99_ms=... http_query_cpu_ms=... http_query_p50_ms=... http_query_p99_ms=...
ingest_blocks_per_s=... bytes_per_block=...

    .venv/bin/python benchmarks/bench_routing.py [--quick] [--part routing|scale|all]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hybridkv.http_serving import tune_for_latency  # noqa: E402
from hybridkv.index.http import AppServer, IndexServer, make_routes  # noqa: E402
from hybridkv.index.seq_hash import seq_hashes  # noqa: E402
from hybridkv.index.service import IndexService, Query  # noqa: E402
from hybridkv.index.table import Registration  # noqa: E402
from hybridkv.kv_events.wire import BlockStored, EventBatch, decode_batch, encode_batch  # noqa: E402
from hybridkv.route.app import RouteConfig  # noqa: E402
from hybridkv.route.app import make_app as make_route_app  # noqa: E402
from hybridkv.route.local import LocalCluster  # noqa: E402
from hybridkv.route.picker import Policy  # noqa: E402
from hybridkv.route.upstream import call, call_with_headers  # noqa: E402

ENGINES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Clients:
    """How the workload is driven (the defaults are the documented run)."""

    clients: int = 4
    think_s: float = 0.05  # a client reads the answer before it sends the next turn
    max_turns: int = 5  # a session runs 2..max_turns requests
    branch_p: float = 1 / 3  # a request branches from an earlier turn (else: the next turn)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    system_prompts: int
    system_tokens: int
    question_tokens: int
    requests: int
    kv_gib: float
    vocab: int


def workload(shape: Shape, seed: int, drive: Clients) -> list[list[list[int]]]:
    """Sessions, each a list of prompts run one after the other (closed loop): a session opens on one
    of K system prompts (popularity skewed) and runs 2-5 requests; each next request is the next
    turn (the previous prompt + an answer + a question) or, one time in three, a branch (an earlier
    turn's prompt + a different question: a regenerated or edited message)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, shape.vocab) for _ in range(shape.system_tokens)] for _ in range(shape.system_prompts)]
    weights = [1 / (k + 1) ** 0.6 for k in range(shape.system_prompts)]

    def words(n: int) -> list[int]:
        return [rng.randrange(3, shape.vocab) for _ in range(n)]

    sessions: list[list[list[int]]] = []
    total = 0
    while total < shape.requests:
        k = rng.choices(range(shape.system_prompts), weights)[0]
        turns = [systems[k] + words(shape.question_tokens)]
        for _ in range(rng.randrange(1, drive.max_turns)):
            if len(turns) > 1 and rng.random() < drive.branch_p:
                base = turns[rng.randrange(len(turns) - 1)]
                turns.append(base + words(shape.question_tokens // 2) + words(shape.question_tokens))
            else:
                turns.append(turns[-1] + words(shape.question_tokens // 2) + words(shape.question_tokens))
        sessions.append(turns)
        total += len(turns)
    return sessions


def documents(shape: Shape, seed: int, drive: Clients) -> list[list[list[int]]]:
    """Sessions over long documents read to different depths (`--workload documents`): K documents
    (popularity skewed), each of 4-6 sections of random length after a shared instruction prompt; a
    session asks 2-5 questions about one document, each with the document up to the section it is
    about (a reader asking about section 2 after section 4, a retrieval step that sends the sections
    up to the one that matched). A request's prefix is a document cut at a section end that earlier
    requests passed without stopping, so an instance may hold its attention blocks without a usable
    point (a state checkpoint, a window tail) there."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(3, shape.vocab) for _ in range(n)]

    instruction = words(shape.question_tokens)
    docs = []
    for _ in range(shape.system_prompts):
        cuts = sorted(rng.sample(range(shape.question_tokens, shape.system_tokens), rng.randrange(3, 6)))
        docs.append((instruction + words(shape.system_tokens), [*cuts, shape.system_tokens]))
    weights = [1 / (k + 1) ** 0.6 for k in range(shape.system_prompts)]
    sessions: list[list[list[int]]] = []
    total = 0
    while total < shape.requests:
        doc, ends = docs[rng.choices(range(shape.system_prompts), weights)[0]]
        turns = [doc[: len(instruction) + rng.choice(ends)] + words(shape.question_tokens)
                 for _ in range(rng.randrange(2, drive.max_turns + 1))]
        sessions.append(turns)
        total += len(turns)
    return sessions


def run_policy(cluster: LocalCluster, policy: Policy, sessions: list[list[list[int]]],
               drive: Clients) -> dict[str, Any]:
    for p in cluster.procs:  # (a cold cache for every policy)
        call(p.url, "/reset_prefix_cache", {})
    time.sleep(0.5)
    cfg = RouteConfig(engines=cluster.engines(), index_url=cluster.index_url, model=cluster.model, policy=policy,
                      poll_every_s=0.5)
    router = AppServer(make_route_app(cfg), lifespan="on", name="bench-route")
    router.start()
    results: list[tuple[int, int]] = []
    calls: list[tuple[float, float, str, int, int]] = []  # (start, end, engine, predicted, cached)
    lock = threading.Lock()
    queue = list(sessions)

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                session = queue.pop(0)
            for prompt in session:
                time.sleep(drive.think_s)
                sent = time.perf_counter()
                status, raw, headers = call_with_headers(
                    router.url, "/v1/completions", {"model": cluster.model, "prompt": prompt, "max_tokens": 1,
                                                    "temperature": 0}, timeout_s=600)
                if status != 200:
                    raise RuntimeError(f"request failed: {status} {raw[:200]!r}")
                cached = int(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"])
                with lock:
                    results.append((cached, len(prompt)))
                    calls.append((sent, time.perf_counter(), headers["x-hybridkv-instance"],
                                  int(headers["x-hybridkv-predicted-tokens"]), cached))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(drive.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    router.stop()
    routed = [e.routed for e in cfg.engines]
    missed = [c for c in calls if c[3] != c[4]]

    def overlapped(c: tuple[float, float, str, int, int]) -> bool:  # (another request on its engine meanwhile)
        return any(o is not c and o[2] == c[2] and o[0] < c[1] and c[0] < o[1] for o in calls)

    concurrent = sum(map(overlapped, missed))
    isolated = [c for c in calls if not overlapped(c)]
    checked = sum(e.checked for e in cfg.engines)
    return {"policy": policy.value, "hit_tokens": sum(r[0] for r in results),
            "prompt_tokens": sum(r[1] for r in results), "routed": routed,
            "balance": max(routed) / max(1, min(routed)), "wall_s": wall,
            "step": math.gcd(*(c[4] for c in calls)),
            "accuracy": sum(e.exact for e in cfg.engines) / checked if checked else float("nan"),
            "over": sum(e.over for e in cfg.engines), "under": sum(e.under for e in cfg.engines),
            "missed_concurrent": concurrent, "stale": cfg.stale_answers, "isolated": len(isolated),
            "accuracy_isolated": sum(c[3] == c[4] for c in isolated) / len(isolated)
            if isolated and policy is not Policy.ROUND_ROBIN else float("nan")}  # (round robin predicts nothing)


def build_gdn(target: Path) -> None:
    import bench_run_policies

    bench_run_policies.build_model(target)


def routing(quick: bool, drive: Clients, extra_args: str = "",
            kind: str = "sessions") -> dict[str, dict[str, dict[str, Any]]]:
    """Per model, per policy: the run_policy results."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    from hybridkv.engine.tokenizer import BYTE_VOCAB

    with tempfile.TemporaryDirectory() as tmp:
        gdn = Path(tmp) / "tiny-gdn"
        build_gdn(gdn)
        models = {
            "swa": ("default-gemma3", Shape(system_prompts=12, system_tokens=384, question_tokens=48,
                                            requests=60 if quick else 240, kv_gib=0.004, vocab=BYTE_VOCAB)),
            "gdn": (str(gdn), Shape(system_prompts=12, system_tokens=1200, question_tokens=96,
                                    requests=60 if quick else 240, kv_gib=0.003, vocab=32000)),
        }
        for name, (model, shape) in models.items():
            sessions = (documents if kind == "documents" else workload)(shape, seed=0, drive=drive)
            args = (f"--kv-cache-memory-gib {shape.kv_gib} --threads 1 --max-num-seqs 4 --max-model-len 4096 "
                    f"--max-num-batched-tokens 2048 {extra_args}")
            cluster = LocalCluster(ENGINES, model=model, engine_args=args, served_model_name=name)
            try:
                out[name] = {}
                for policy in (Policy.JOINT, Policy.ATTENTION, Policy.ROUND_ROBIN):
                    r = run_policy(cluster, policy, sessions, drive)
                    out[name][policy.value] = r
                    print(f"model={name} policy={policy.value} hit_tokens={r['hit_tokens']} "
                          f"prompt_tokens={r['prompt_tokens']} routed={r['routed']} balance={r['balance']:.2f} "
                          f"accuracy={r['accuracy']:.4f} over={r['over']} under={r['under']} "
                          f"missed_concurrent={r['missed_concurrent']} accuracy_isolated={r['accuracy_isolated']:.4f} "
                          f"(of {r['isolated']}) stale={r['stale']} wall_s={r['wall_s']:.1f}",
                          flush=True)
                step = out[name]["joint"]["step"] or 1
                ideal = ideal_hits(sessions, step)
                out[name]["ideal"] = {"hit_tokens": ideal}
                print(f"model={name} ideal_hit_tokens={ideal} (one engine, unbounded cache, a usable point at every "
                      f"{step} tokens) joint_vs_ideal={out[name]['joint']['hit_tokens'] / max(1, ideal):.3f} "
                      f"ideal_vs_rr={ideal / max(1, out[name]['round_robin']['hit_tokens']):.3f}", flush=True)
            finally:
                cluster.close()
    return out


def ideal_hits(sessions: list[list[list[int]]], step: int) -> int:
    """The hit tokens of one engine with an unbounded cache and a usable point every `step` tokens (the
    hit granularity the engines showed: the gcd of their hits), serving the sessions one after the
    other: each prompt's longest prefix shared with any earlier prompt, in whole steps, at most the
    prompt's length - 1. No router over engines with bounded caches gets more (up to the order the
    clients interleave sessions in)."""
    seen: set[int] = set()
    total = 0
    for session in sessions:
        for prompt in session:
            keys, key = [], 0
            for start in range(0, len(prompt) - step + 1, step):
                key = hash((key, tuple(prompt[start : start + step])))
                keys.append(key)
            hit = 0
            for k, key in enumerate(keys):
                if key not in seen:
                    break
                hit = k + 1
            total += min(hit * step, (len(prompt) - 1) // step * step)
            seen.update(keys)
    return total


def _batches(instance: int, num_blocks: int, block_size: int, rng: random.Random) -> list[bytes]:
    """Chains of 64 blocks (one BlockStored each), as msgpack payloads of 16 events."""
    payloads, events = [], []
    next_hash = instance << 40
    for _ in range(num_blocks // 64):
        tokens = [rng.randrange(1 << 17) for _ in range(64 * block_size)]
        events.append(BlockStored(block_hashes=list(range(next_hash, next_hash + 64)), parent_block_hash=None,
                                  token_ids=tokens, block_size=block_size, lora_id=None, medium="GPU", lora_name=None,
                                  group_idx=0, kv_cache_spec_kind="full_attention"))
        next_hash += 64
        if len(events) == 16:
            payloads.append(encode_batch(EventBatch(ts=0.0, events=events)))
            events = []
    if events:
        payloads.append(encode_batch(EventBatch(ts=0.0, events=events)))
    return payloads


def scale(quick: bool) -> dict[str, float]:
    total = 100_000 if quick else 1_000_000
    block = 16
    rng = random.Random(0)
    service = IndexService(subscribe=False, max_blocks=total + 10_000)
    keys = [("default", f"e{i}", 0) for i in range(ENGINES)]
    for key in keys:
        service.register(Registration(key=key, model="m", lora_name=None, block_size=block), None, None)
    payloads = [_batches(i, total // ENGINES, block, rng) for i in range(ENGINES)]
    start = time.perf_counter()
    for key, batches in zip(keys, payloads, strict=True):
        for payload in batches:
            service.apply(key, decode_batch(payload))
    ingest_s = time.perf_counter() - start
    # memory: one instance's share ingested again into an empty index, under tracemalloc (which
    # slows allocation several fold: not timed)
    probe = IndexService(subscribe=False, max_blocks=total)
    probe.register(Registration(key=keys[0], model="m", lora_name=None, block_size=block), None, None)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for payload in payloads[0]:
        probe.apply(keys[0], decode_batch(payload))
    held = (tracemalloc.get_traced_memory()[0] - before) / probe.table.num_blocks
    tracemalloc.stop()
    del probe
    blocks = service.table.num_blocks
    # the worst case of a 32k-token prompt: all 2048 blocks held by e0, the first 512 by the others
    # (the walk cannot stop early), among the 1M other blocks
    prompt = [rng.randrange(1 << 17) for _ in range(32768)]
    for i, key in enumerate(keys):
        n = 2048 if i == 0 else 512
        service.apply(key, EventBatch(ts=0.0, events=[BlockStored(
            block_hashes=list(range(1 << 50, (1 << 50) + n)), parent_block_hash=None, token_ids=prompt[: n * block],
            block_size=block, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
            kv_cache_spec_kind="full_attention")]))
    prompt.append(1)
    times = []
    for _ in range(50 if quick else 300):
        t = time.perf_counter()
        answer = service.query(Query(model="m", token_ids=prompt))
        times.append(time.perf_counter() - t)
    assert answer["default"]["e0"]["longest_matched"] == 32768, answer["default"]["e0"]
    hashes = seq_hashes(prompt, block)  # (a router that hashes prompts itself: /query_by_hash)
    by_hash = Query(model="m", seq_hashes=hashes, block_size=block, num_tokens=len(prompt))
    hash_times = []
    for _ in range(50 if quick else 300):
        t = time.perf_counter()
        answer = service.query(by_hash)
        hash_times.append(time.perf_counter() - t)
    assert answer["default"]["e0"]["longest_matched"] == 32768, answer["default"]["e0"]
    server = IndexServer(make_routes(service))
    tune_for_latency()  # (as `hybridkv index` does before it serves)
    server.start()
    n_http = 30 if quick else 1000
    cpu = time.process_time()  # (this process's CPU: the server thread's alone while the client process runs)
    http_times = http_latencies(server.url, json.dumps({"model": "m", "token_ids": prompt, "block_size": block}),
                                n_http)
    http_cpu_ms = (time.process_time() - cpu) / (n_http + 20) * 1e3  # (+ the client's 20 warm-up requests)
    server.stop()
    q = statistics.quantiles
    result = {"load_1m": os.getloadavg()[0], "blocks": blocks, "ingest_blocks_per_s": blocks / ingest_s,
              "bytes_per_block": held,
              "query_p50_ms": q(times, n=100)[49] * 1e3, "query_p99_ms": q(times, n=100)[98] * 1e3,
              "query_by_hash_p50_ms": q(hash_times, n=100)[49] * 1e3,
              "query_by_hash_p99_ms": q(hash_times, n=100)[98] * 1e3,
              "http_query_cpu_ms": http_cpu_ms, "http_query_p50_ms": q(http_times, n=100)[49] * 1e3,
              "http_query_p99_ms": q(http_times, n=100)[98] * 1e3}
    print("scale " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()),
          flush=True)
    return result


def http_latencies(url: str, body: str, n: int) -> list[float]:
    """`/query` latencies seen by a client in another process (its own interpreter and GIL), over one
    kept-alive connection as a router holds it; the body is encoded before the clock starts."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(body)
    try:
        out = subprocess.run([sys.executable, __file__, "--query-client", url, f.name, str(n)], check=True,
                             capture_output=True, text=True, timeout=600).stdout
    finally:
        os.unlink(f.name)
    times: list[float] = json.loads(out.strip().splitlines()[-1])
    return times


def query_client(url: str, body_path: str, n: int) -> None:
    """The client side of `http_latencies`: POST the body n times (after 20 unmeasured), print the times.

    The request (head and body) is encoded once and sent with one `sendall`; the reply is read up to
    its Content-Length: a router's pooled client costs about that, while `http.client` adds ~0.2 ms of
    its own Python per request to what is measured."""
    from urllib.parse import urlsplit

    body = Path(body_path).read_bytes()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = (f"POST /query HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    sock = socket.create_connection((host, port), timeout=30)
    # (no Nagle, as routers' HTTP clients set it, Go's and Rust's hyper included: otherwise a body's
    # last partial segment waits for the server's delayed ACK, 40 ms)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for i in range(n + 20):
        t = time.perf_counter()
        sock.sendall(request)
        status, reply = _read_reply(sock)
        if i >= 20:
            times.append(time.perf_counter() - t)
        if status != 200:
            raise RuntimeError(f"/query answered {status}: {reply[:200]!r}")
    sock.close()
    print(json.dumps(times))


def _read_reply(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 reply with a Content-Length: (status, body)."""
    data = b""
    while (head_end := data.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("the index closed the connection")
        data += chunk
    head = data[:head_end].decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in head if line.lower().startswith("content-length:"))
    while len(data) < head_end + 4 + length:
        data += sock.recv(65536)
    return int(head[0].split()[1]), data[head_end + 4 : head_end + 4 + length]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and blocks (CI smoke run)")
    parser.add_argument("--part", choices=["routing", "scale", "all"], default="all")
    default = Clients()
    parser.add_argument("--clients", type=int, default=default.clients, help="clients at once")
    parser.add_argument("--think-s", type=float, default=default.think_s, help="a client's pause between requests")
    parser.add_argument("--max-turns", type=int, default=default.max_turns, help="most requests per session")
    parser.add_argument("--branch-p", type=float, default=default.branch_p, help="share of branch requests")
    parser.add_argument("--workload", choices=["sessions", "documents"], default="sessions",
                        help="sessions: turns extending one another (the documented run); documents: questions "
                        "about long documents cut at different sections (docs/routing.md)")
    parser.add_argument("--engine-args", default="", help="more `hybridkv serve` flags for every engine (e.g. "
                        "'--prefix-cache-retention-interval 0': tails and checkpoints kept at prompt ends only)")
    parser.add_argument("--query-client", nargs=3, metavar=("URL", "BODY", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.query_client:
        query_client(args.query_client[0], args.query_client[1], int(args.query_client[2]))
        return 0
    drive = Clients(clients=args.clients, think_s=args.think_s, max_turns=args.max_turns, branch_p=args.branch_p)
    parts: list[str] = []
    if args.part in ("scale", "all"):
        s = scale(args.quick)
        parts += [f"query_p99_ms={s['query_p99_ms']:.3f}", f"query_by_hash_p99_ms={s['query_by_hash_p99_ms']:.3f}",
                  f"http_query_cpu_ms={s['http_query_cpu_ms']:.3f}", f"http_query_p50_ms={s['http_query_p50_ms']:.3f}",
                  f"http_query_p99_ms={s['http_query_p99_ms']:.3f}",
                  f"ingest_blocks_per_s={s['ingest_blocks_per_s']:.0f}", f"bytes_per_block={s['bytes_per_block']:.0f}"]
    if args.part in ("routing", "all"):
        r = routing(args.quick, drive, args.engine_args, args.workload)
        accuracy = min(r[m]["joint"]["accuracy"] for m in r)
        isolated = min(r[m]["joint"]["accuracy_isolated"] for m in r)
        ratios = []
        for m in ("gdn", "swa"):
            joint = r[m]["joint"]["hit_tokens"]
            rr = max(1, r[m]["round_robin"]["hit_tokens"])
            ratios += [f"joint_vs_attention_{m}={joint / max(1, r[m]['attention']['hit_tokens']):.3f}",
                       f"joint_vs_rr_{m}={joint / rr:.3f}", f"ideal_vs_rr_{m}={r[m]['ideal']['hit_tokens'] / rr:.3f}"]
        balance = max(r[m][p]["balance"] for m in r for p in r[m] if p != "ideal")
        parts = [f"accuracy={accuracy:.4f}", f"accuracy_isolated={isolated:.4f}", *ratios, f"balance_max={balance:.2f}",
                 *parts]
    print(" ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
