#!/usr/bin/env python
"""vLLM 0.32's real KV cache manager behind the verbs `hybridkv simulate`'s loop calls.

Run by `bench_hits.py` under the vLLM venv (PYTHONPATH: this repository, and an overlay with
xxhash when the venv lacks it). Reads a job (JSON on stdin: the layout as our planner planned
it, the trace generator and the scheduler options), replays the trace through
`hybridkv.simulate.simulator.simulate` -- the engine's own `Scheduler`, the same synthetic
tokens -- with `VLLMManager` below in place of our manager, and prints the report as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request, RequestStatus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hits
import vllm_manager

from hybridkv.kvcache.manager import CacheHit, ManagerStats
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.planner import KVCacheConfig as OurConfig
from hybridkv.plan.specs import SpecKind
from hybridkv.simulate.simulator import simulate


def vllm_config(ours: OurConfig, *, mamba_mode: str, retention: int | None) -> KVCacheConfig:
    """Our plan's groups as vLLM specs (head sizes are irrelevant to the manager)."""
    specs: list[Any] = []
    for g in ours.groups:
        if g.kind is SpecKind.FULL:
            specs.append(vllm_manager.full(g.block_size))
        elif g.kind is SpecKind.SLIDING_WINDOW:
            specs.append(vllm_manager.sliding(g.block_size, g.window_tokens))
        elif g.kind is SpecKind.MAMBA:
            specs.append(vllm_manager.state(g.block_size, mamba_mode))
        else:
            raise SystemExit(f"group kind {g.kind.value!r} is not driven here")
    return vllm_manager.config(specs, num_blocks=ours.num_blocks, retention=retention)


class VLLMManager:
    """The verbs `Scheduler` calls, over vLLM's manager; each `KVRequest` mirrored into a vLLM `Request`
    (tokens appended as the loop appends them, `num_computed_tokens` copied before each call)."""

    def __init__(self, config: KVCacheConfig, *, max_model_len: int, use_eagle: bool = False,
                 prefix_match_unit: int | None = None) -> None:
        self.hash_block = vllm_manager.matched_hash_block_size(config, prefix_match_unit)
        self.manager = vllm_manager.manager(config, max_model_len=max_model_len, use_eagle=use_eagle,
                                            hash_block=self.hash_block)
        self.requests: dict[str, Request] = {}
        self.found: dict[str, Any] = {}
        self.lookups = 0

    def _sync(self, kv: KVRequest) -> Request:
        request = self.requests.get(kv.request_id)
        if request is None:
            request = self.requests[kv.request_id] = vllm_manager.request(kv.request_id, list(kv.token_ids),
                                                                          hash_block=self.hash_block)
        for token in kv.token_ids[request.num_tokens:]:
            request.append_output_token_ids(token)
        request.num_computed_tokens = kv.num_computed_tokens
        return request

    def begin_step(self) -> None:
        self.manager.new_step_starts()

    def protect(self, hit: CacheHit) -> None:
        """vLLM 0.32 has no queue-aware retention."""
        del hit

    protects = False  # (so the scheduler never calls protect_waiting)

    def lookup(self, kv: KVRequest) -> CacheHit:
        self.lookups += 1
        request = self._sync(kv)
        blocks, num_tokens, boundary = self.manager.get_computed_blocks(request)
        # vLLM's scheduler keeps the junction on its request (sliding-window retention reads it);
        # the loop's scheduler reads ours (align-mode chunk stops)
        request.shared_prefix_boundary = kv.shared_prefix_boundary = boundary
        self.found[kv.request_id] = blocks
        return CacheHit(request_id=kv.request_id, num_tokens=num_tokens, blocks=())

    def allocate(self, kv: KVRequest, num_new_tokens: int, *, hit: CacheHit | None = None, **_: Any) -> Any:
        request = self._sync(kv)
        if hit is not None:
            new = self.manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens=hit.num_tokens,
                                              new_computed_blocks=self.found[kv.request_id])
        else:
            new = self.manager.allocate_slots(request, num_new_tokens)
        if new is None:
            return None
        request.status = RequestStatus.RUNNING
        return ()

    def free(self, kv: KVRequest) -> None:
        request = self.requests.get(kv.request_id)
        if request is not None:
            self.manager.free(request)
            request.status = RequestStatus.PREEMPTED

    def usage(self) -> float:
        return float(self.manager.usage)

    def peek(self, kv: KVRequest) -> int:
        """vLLM 0.34's `KVCacheManager.get_num_cached_tokens` (the cache-aware admission probe), on this
        manager: the longest hit up to the last token, taking nothing."""
        request = self._sync(kv)
        if not self.manager.prefix_cache_lookup_enabled(request):
            return 0
        return int(self.manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[1])

    def take_pending_copies(self) -> tuple[Any, ...]:
        """What vLLM's scheduler does at the end of `schedule()` (no async scheduling): drain the
        copy-on-write copies of partial hits and release the blocks they held."""
        copies, retained = self.manager.take_kv_cache_block_copies()
        if retained:
            self.manager.block_pool.free_blocks(retained)
        return tuple(copies)

    def take_checkpoint_copies(self) -> tuple[Any, ...]:
        """vLLM's align mode moves its running state: no checkpoint is copied after a step."""
        return ()

    def stats(self) -> ManagerStats:
        return ManagerStats(lookups=self.lookups, query_tokens=0, hit_tokens=0, group_hit_tokens=())


def run(job: dict[str, Any]) -> dict[str, Any]:
    ours, trace, options = bench_hits.materialize(job)
    manager = VLLMManager(vllm_config(ours, mamba_mode=job["mamba_cache_mode"], retention=job["retention"]),
                          max_model_len=options.max_model_len, use_eagle=job["spec_decode"] == "eagle",
                          prefix_match_unit=options.cache.prefix_match_unit)
    report = simulate(trace, ours, options, manager=manager)  # type: ignore[arg-type]
    return {"request_hits": report.request_hits, "hit_tokens": report.hit_tokens,
            "preemptions": report.preemptions, "ideal_tokens": report.ideal_tokens,
            "prefill_tokens": report.prefill_tokens, "mean_held_fraction": report.mean_held_fraction,
            "mean_wait_ms": report.mean_wait_ms, "p95_wait_ms": report.p95_wait_ms}


def main() -> int:
    print(json.dumps([run(job) for job in json.load(sys.stdin)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
