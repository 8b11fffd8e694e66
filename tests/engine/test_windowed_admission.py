"""vLLM 0.34's cache-aware admission window (`queue_order.windowed`) against hand-computed orders and
against vLLM 0.34's own `Scheduler._reorder_waiting_by_cached_prefix`.

- recorded: `vllm_fixtures/cache_aware_admission_034.json` (vLLM 0.34.0's orders for the seeded
  cases below, written by `record()` through `benchmarks/vllm_admission_driver.py`), everywhere;
- live: the same cases through vLLM 0.34 where its venv exists (`benchmarks/vllm034_venv.sh`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridkv.kvcache.options import CacheOptions
from hybridkv.scheduling.queue_order import WindowedAdmission, windowed

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "vllm_fixtures" / "cache_aware_admission_034.json"
VENV = Path(os.environ.get("HYBRIDKV_VLLM034_VENV", Path.home() / ".cache/hybridkv-bench/vllm034-venv"))


@dataclass(frozen=True)
class Waiting:
    request_id: str
    preempted: bool = False
    computed: int = 0
    cached: int = 0


def order(queue: list[Waiting], *, window: int, threshold: float = 0.5, usage: float = 1.0) -> list[str]:
    out = windowed(deque(queue), lambda r: r.cached, WindowedAdmission(window=window, threshold=threshold),
                   usage=usage, movable=lambda r: not r.preempted and not r.computed)
    return [r.request_id for r in out]


def test_hand_computed_order() -> None:
    queue = [Waiting("a"), Waiting("b", cached=5), Waiting("c", preempted=True, cached=7), Waiting("d", cached=9),
             Waiting("e", cached=99)]
    # slots a b _ d (c preempted keeps its place, e is beyond the window): deepest first d 9, b 5, a 0
    assert order(queue, window=4) == ["d", "b", "c", "a", "e"]
    assert order(queue, window=4, usage=0.49) == ["a", "b", "c", "d", "e"]  # below the threshold
    assert order(queue, window=5, usage=0.5) == ["e", "d", "c", "b", "a"]
    assert order(queue, window=1) == ["a", "b", "c", "d", "e"]
    ties = [Waiting("x", cached=3), Waiting("y", computed=16, cached=50), Waiting("z", cached=3)]
    assert order(ties, window=8, threshold=0.0, usage=0.0) == ["x", "y", "z"]  # ties keep queue order


def test_options_check_the_two_fields() -> None:
    assert WindowedAdmission.of(CacheOptions(cache_aware_admission_window=16)).on
    assert not WindowedAdmission.of(CacheOptions().replace(cache_aware_admission_window=16, prefix_caching="off")).on
    with pytest.raises(ValueError, match="cache_aware_admission_threshold must be a number in"):
        CacheOptions(cache_aware_admission_threshold=1.5)
    with pytest.raises(ValueError, match="cache_aware_admission_window must be an integer >= 0"):
        CacheOptions(cache_aware_admission_window=-1)


def cases(seed: int = 0, count: int = 200) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for _ in range(count):
        n = rng.randint(0, 12)
        queue = [[f"r{i}", rng.random() < 0.2, rng.choice([0, 0, 0, 16]), rng.choice([0, 16, 32, 64, 64, 512])]
                 for i in range(n)]
        out.append({"window": rng.randint(0, 10), "threshold": rng.choice([0.0, 0.5, 0.9]),
                    "usage": rng.choice([0.0, 0.49, 0.5, 0.95]), "queue": queue})
    return out


def ours(case: dict[str, object]) -> list[str]:
    queue = [Waiting(rid, preempted, computed, cached) for rid, preempted, computed, cached in case["queue"]]  # type: ignore[attr-defined]
    if not case["window"]:  # vLLM skips the call with the window off
        return [r.request_id for r in queue]
    return order(queue, window=int(case["window"]), threshold=float(case["threshold"]),  # type: ignore[arg-type]
                 usage=float(case["usage"]))  # type: ignore[arg-type]


def vllm_orders(batch: list[dict[str, object]]) -> dict[str, object]:
    live = [c if c["window"] else {**c, "queue": []} for c in batch]
    done = subprocess.run([str(VENV / "bin" / "python"), str(REPO / "benchmarks" / "vllm_admission_driver.py")],
                          input=json.dumps(live), capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["orders"] = [o if c["window"] else [q[0] for q in c["queue"]]  # type: ignore[attr-defined]
                        for o, c in zip(result["orders"], batch, strict=True)]  # type: ignore[call-overload]
    return result


def record() -> None:
    """Write the fixture from vLLM 0.34 (`python -c 'from tests.engine.test_windowed_admission import record;
    record()'`)."""
    FIXTURE.write_text(json.dumps(vllm_orders(cases()), separators=(",", ":")) + "\n")


def test_equals_vllm_034_recorded() -> None:
    recorded = json.loads(FIXTURE.read_text())
    assert recorded["vllm_version"] == "0.34.0"
    batch = cases()
    assert [ours(c) for c in batch] == recorded["orders"]
    assert sum(o != [q[0] for q in c["queue"]] for o, c in zip(recorded["orders"], batch, strict=True)) > 20  # type: ignore[attr-defined]


@pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason="vLLM 0.34's venv is not built")
def test_equals_vllm_034_live() -> None:
    batch = cases(seed=1)
    assert [ours(c) for c in batch] == vllm_orders(batch)["orders"]


@pytest.mark.parametrize(("threshold", "first"), [(0.0, "r2"), (0.5, "r1")])
def test_the_scheduler_applies_the_window_from_its_usage_threshold(threshold: float, first: str) -> None:
    """r0 leaves a 24-token prefix cached and the pool empty (usage 0): with threshold 0 the window
    admits r2 (which hits it) before r1, which arrived first; with vLLM's default 0.5 nothing moves."""
    from tests.engine.test_queue_order import request, tokens
    from tests.engine.test_scheduler import make_scheduler, step

    scheduler = make_scheduler(blocks=64, budget=64, max_num_seqs=1)
    scheduler.window = WindowedAdmission(window=4, threshold=threshold)
    shared = tokens(0, 24)
    scheduler.add(request(0, shared + tokens(10, 4)))
    while scheduler.has_unfinished:
        step(scheduler)
    assert scheduler.manager.usage() == 0.0
    scheduler.add(request(1, tokens(11, 20)))
    scheduler.add(request(2, shared + tokens(12, 4)))
    out = step(scheduler)
    assert [w.request.request_id for w in out.work] == [first]
    assert out.work[0].start_pos == (24 if first == "r2" else 0)
    while scheduler.has_unfinished:
        step(scheduler)
