#!/usr/bin/env python
"""Record vLLM 0.32's real KV cache manager's prefix hits on the shared seeded traces.

Runs under the vLLM manager venv (vLLM's real `KVCacheManager`, no model):

    bash benchmarks/vllm_manager_venv.sh
    ~/.cache/hybridkv-bench/vllm-manager-venv/bin/python \\
        tests/kvcache/vllm_fixtures/generate_vllm_hits.py --out tests/kvcache/vllm_fixtures/mamba_hits.json

Layout: 1 full-attention group + 1 Mamba group (built by `benchmarks/vllm_manager.py`), blocks
of 16 tokens, a pool large enough to never evict. For each `mamba_cache_mode` (align, all) and
case (seed, token budget, max running) in `vllm_traces.CASES`, `vllm_traces.replay` drives
vLLM's manager exactly as vLLM's scheduler calls it (`new_step_starts`, `get_computed_blocks`,
`allocate_slots`, `free`) and records, per request, its admission step and hit tokens. Nothing
from hybridkv is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/kvcache: vllm_traces
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(HERE))), "benchmarks"))

import vllm_traces  # noqa: E402

CASES = vllm_traces.CASES
NUM_BLOCKS = 4000
BLOCK_TOKENS = 16


class VLLMDriver:
    """vllm_traces.Driver over vLLM's real manager."""

    def __init__(self, mode: str) -> None:
        import vllm_manager as vm
        from vllm.v1.request import RequestStatus

        self.vm = vm
        self.running_status = RequestStatus.RUNNING
        specs = [vm.full(BLOCK_TOKENS), vm.state(BLOCK_TOKENS, mode)]
        self.manager = vm.manager(vm.config(specs, num_blocks=NUM_BLOCKS), max_model_len=8192)
        self.hits: dict[str, tuple[object, int]] = {}

    def begin_step(self) -> None:
        self.manager.new_step_starts()

    def new_request(self, index: int, prompt: list[int]) -> object:
        return self.vm.request(f"r{index}", prompt, hash_block=BLOCK_TOKENS)

    def lookup(self, request) -> int:  # type: ignore[no-untyped-def]
        blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        self.hits[request.request_id] = (blocks, num_hit)
        return int(num_hit)

    def admit(self, request, num_new_tokens: int) -> bool:  # type: ignore[no-untyped-def]
        blocks, num_hit = self.hits.pop(request.request_id)
        new = self.manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens=num_hit,
                                          new_computed_blocks=blocks)
        if new is None:
            return False
        request.status = self.running_status
        return True

    def extend(self, request, num_new_tokens: int) -> bool:  # type: ignore[no-untyped-def]
        return self.manager.allocate_slots(request, num_new_tokens) is not None

    def append_token(self, request, token: int) -> None:  # type: ignore[no-untyped-def]
        request.append_output_token_ids(token)

    def computed(self, request, num_tokens: int) -> None:  # type: ignore[no-untyped-def]
        request.num_computed_tokens = num_tokens

    def free(self, request) -> None:  # type: ignore[no-untyped-def]
        self.manager.free(request)


def record() -> dict[str, object]:
    import vllm

    result: dict[str, object] = {"vllm_version": vllm.__version__, "num_blocks": NUM_BLOCKS, "modes": {}}
    for mode in ("align", "all"):
        per_seed = {}
        for case in CASES:
            driver = VLLMDriver(mode)
            per_seed[vllm_traces.case_name(case)] = vllm_traces.replay_case(driver, case, mode=mode)
            assert driver.manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
        result["modes"][mode] = per_seed  # type: ignore[index]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1] if __doc__ else None)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    text = json.dumps(record(), indent=None, separators=(",", ":"))
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
