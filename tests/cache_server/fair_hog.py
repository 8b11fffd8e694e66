"""The hog of test_fair_slicing.py, in its own process (its own GIL): an engine that keeps a KV cache
server busy with the largest requests until its stdin closes.

    python -m tests.cache_server.fair_hog ENDPOINT lookup|store_retrieve

`lookup`: lookups of MAX_CHUNKS_PER_REQUEST chunk hashes (misses). `store_retrieve`: stores of 4,000
chunks of 8 KiB, then lookups and retrieves of them, in turn (its pages must come back unchanged).
Prints "ready" once registered, "busy" after its first two requests, and at the end one JSON line:
{"seconds": [each request's time], "error": "" or what went wrong}.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from hybridkv.cache_server import limits
from hybridkv.connector.client import KVClient, chunk_hashes
from tests.cache_server.helpers import FakeEngine, make_engine, make_group

CHUNK = 8
GROUPS = [make_group(block=4, page=4096)]  # 8 KiB per chunk
STORED_CHUNKS = 4000  # 32 MiB copied each way, in slices


def huge_lookups(client: KVClient, _engine: FakeEngine) -> Callable[[], None]:
    huge = [i.to_bytes(16, "little") for i in range(limits.MAX_CHUNKS_PER_REQUEST)]

    def one() -> None:
        client.lookup(huge, num_tokens=len(huge) * CHUNK + 1)

    return one


def stores_and_retrieves(client: KVClient, engine: FakeEngine) -> Callable[[], None]:
    hashes = chunk_hashes(list(range(10**6, 10**6 + STORED_CHUNKS * CHUNK + 1)), CHUNK)
    blocks = list(range(100, 100 + 2 * STORED_CHUNKS))
    kv = engine.buffers.arrays[0]
    pages = kv[100 * 4096:(100 + 2 * STORED_CHUNKS) * 4096]
    before = pages.copy()
    rounds = [0]

    def one() -> None:
        if rounds[0] % 2 == 0:
            if not all(client.store(first_chunk=0, chunk_hashes=hashes, block_ids=[blocks]).stored):
                raise RuntimeError("a store of the hog's chunks was refused")
        else:
            hit = client.lookup(hashes, num_tokens=STORED_CHUNKS * CHUNK + 1)
            if hit.hit_tokens != STORED_CHUNKS * CHUNK:
                raise RuntimeError(f"the hog's lookup hit {hit.hit_tokens} tokens, expected {STORED_CHUNKS * CHUNK}")
            client.retrieve(hit.lookup_id, block_ids=[blocks])
            if not np.array_equal(pages, before):
                raise RuntimeError("the hog's retrieved pages differ from the ones it stored")
        rounds[0] += 1

    return one


def main(endpoint: str, mode: str) -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    seconds: list[float] = []
    error = ""
    engine = make_engine(GROUPS, num_blocks=2 * STORED_CHUNKS + 200)
    engine.fill_random(2)
    try:
        with KVClient(endpoint, timeout_s=120, connect_timeout_s=5) as client:
            client.register(engine.layout)
            request = {"lookup": huge_lookups, "store_retrieve": stores_and_retrieves}[mode](client, engine)
            print("ready", flush=True)
            while not stop.is_set():
                t0 = time.perf_counter()
                request()
                seconds.append(time.perf_counter() - t0)
                if len(seconds) == 2:
                    print("busy", flush=True)
    except Exception as e:  # reported to the test
        error = f"{type(e).__name__}: {e}"
    finally:
        engine.close()
    print(json.dumps({"seconds": seconds, "error": error}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
