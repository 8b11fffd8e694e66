#!/usr/bin/env python
"""vLLM 0.34's cache-aware admission reorder, run on given queues (under vLLM 0.34's venv).

Reads a JSON list of cases on stdin, each `{"window", "threshold", "usage", "queue": [[id, preempted,
num_computed_tokens, cached_tokens], ...]}`, runs vLLM's own `Scheduler._reorder_waiting_by_cached_prefix`
on a scheduler stub holding vLLM's `FCFSRequestQueue` of request stubs (the method reads only the
queue, the window, the threshold, each request's status and computed tokens, and the manager's
`usage` and `get_num_cached_tokens`), and prints `{"vllm_version", "orders": [[id, ...], ...]}`.

    bash benchmarks/vllm034_venv.sh && ~/.cache/hybridkv-bench/vllm034-venv/bin/python \
        benchmarks/vllm_admission_driver.py < cases.json
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import vllm
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus


class _Request:
    """What the reorder reads of a vLLM `Request` (hashed by identity, as vLLM's queue removes by set)."""

    def __init__(self, request_id: str, status: RequestStatus, num_computed_tokens: int) -> None:
        self.request_id, self.status, self.num_computed_tokens = request_id, status, num_computed_tokens


def reorder(case: dict[str, object]) -> list[str]:
    queue = FCFSRequestQueue()
    cached: dict[str, int] = {}
    for rid, preempted, computed, hit in case["queue"]:  # type: ignore[attr-defined]
        status = RequestStatus.PREEMPTED if preempted else RequestStatus.WAITING
        queue.add_request(_Request(rid, status, computed))  # type: ignore[arg-type]
        cached[rid] = hit
    manager = SimpleNamespace(usage=case["usage"], get_num_cached_tokens=lambda r: cached[r.request_id])
    stub = SimpleNamespace(waiting=queue, kv_cache_manager=manager, cache_aware_window=case["window"],
                           cache_aware_threshold=case["threshold"])
    Scheduler._reorder_waiting_by_cached_prefix(stub)  # type: ignore[arg-type]
    return [r.request_id for r in stub.waiting]


def main() -> int:
    cases = json.load(sys.stdin)
    print(json.dumps({"vllm_version": vllm.__version__, "orders": [reorder(c) for c in cases]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
