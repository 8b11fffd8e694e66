"""Recurrent-state models (Gated DeltaNet hybrids, LFM2's short convolutions) on the paged cache:
prefix hits restore exact states, the same-step rule, a negative control, preemption, and the planned memory.

The tiny Qwen3.5 has 16-token state blocks (the planner raises the block size so one attention
page holds a state). With a 40-token budget the scheduler cuts prefill chunks on block
boundaries in align mode, so a 70-token prompt leaves checkpoints after 32 and 64 tokens; in
all mode the chunks stay [0, 40) and [40, 70) and the same forward leaves a checkpoint at every
boundary (16, 32, 48, 64).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.engine import kernels
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.manager import PrefixCaching
from hybridkv.plan.specs import SpecKind
from tests.engine.conftest import hf_greedy, prompts
from tests.engine.state_checks import assert_corrupted_restore_changes_outputs

GREEDY = SamplingParams(max_tokens=8, eos=EosMode.IGNORE, logprobs=1)
OPTIONS: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=40, block_size=4, kv_cache_memory_gib=0.01)


def _shared_prefix(prefix_tokens: int) -> tuple[list[int], list[int]]:
    first, tail = prompts([70, 13], seed=7)
    return first, first[:prefix_tokens] + tail


def _cold(path: Path, prompt: list[int]) -> Any:
    return LLM(str(path), prefix_caching=PrefixCaching.OFF, **OPTIONS).generate([prompt], GREEDY)[0]


@pytest.mark.parametrize(("kind", "mode", "prefix", "expected_hit"), [
    ("qwen3_5", "align", 40, 32),  # the shared prefix ends mid-block: the hit is the checkpoint before it
    ("qwen3_5", "align", 56, 32),  # boundary 48 was crossed inside a step (no checkpoint): still 32
    ("qwen3_next", "align", 64, 64),  # ends on a checkpoint
    ("qwen3_5", "all", 56, 48),  # all mode: any block boundary, also inside a step
    ("qwen3_5_moe", "all", 20, 16),
    ("lfm2", "align", 40, 32),  # LFM2's short-conv state (no recurrent state)
    ("lfm2", "all", 56, 48),
    ("lfm2_moe", "align", 40, 32),
])
def test_prefix_hit_restores_the_state_checkpoint(
    kind: str, mode: str, prefix: int, expected_hit: int, model_dir: Callable[[str], Path],
    hf_model: Callable[[Path], Any],
) -> None:
    path = model_dir(kind)
    first, second = _shared_prefix(prefix)
    cached = LLM(str(path), mamba_cache_mode=mode, **OPTIONS)
    cached.generate([first], GREEDY)
    hit = cached.generate([second], GREEDY)[0]
    assert hit.metrics.prefix_hit_tokens == expected_hit
    stats = cached.manager_stats()
    state_groups = [g.group_id for g in cached.plan.config.groups if g.kind is SpecKind.MAMBA]
    assert state_groups and all(stats.group_hit_tokens[g] >= expected_hit for g in range(len(stats.group_hit_tokens)))
    cold = _cold(path, second)
    assert hit.token_ids == cold.token_ids == hf_greedy(hf_model(path), second, 8)[0]


def test_the_plain_torch_scans_restore_the_same_checkpoints(
    model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the state mixers' conv, chunked scan, decode step and gated norm in torch (no compiler, HYBRIDKV_KERNELS=0)
    monkeypatch.setattr(kernels, "kernels_available", lambda: False)
    path = model_dir("qwen3_5")
    first, second = _shared_prefix(56)
    cached = LLM(str(path), mamba_cache_mode="all", **OPTIONS)
    cached.generate([first], GREEDY)
    hit = cached.generate([second], GREEDY)[0]
    assert hit.metrics.prefix_hit_tokens == 48
    assert hit.token_ids == hf_greedy(hf_model(path), second, 8)[0]


@pytest.mark.parametrize("kind", ["qwen3_5", "lfm2"])
def test_corrupting_the_restored_state_changes_the_outputs(kind: str, model_dir: Callable[[str], Path]) -> None:
    """Negative control: the comparison above fails when the restored state is wrong (the recurrent state;
    LFM2 has only its conv state)."""
    first, second = _shared_prefix(40)
    assert_corrupted_restore_changes_outputs(model_dir(kind), first, second, options=OPTIONS, params=GREEDY,
                                             expected_hit=32)


@pytest.mark.parametrize("mode", ["align", "all"])
def test_requests_of_one_step_never_restore_a_checkpoint_written_in_that_step(
    mode: str, model_dir: Callable[[str], Path],
) -> None:
    """Two prompts sharing 35 tokens arrive together: the second may hit the first's checkpoint
    after 32 tokens only from the next step on, once it has been written."""
    path = model_dir("qwen3_5")
    first = prompts([40], seed=11)[0]
    second = [*first[:35], 5, 6, 7]
    options = {**OPTIONS, "max_num_batched_tokens": 64}
    llm = LLM(str(path), mamba_cache_mode=mode, **options)
    outputs = llm.generate([first, second], GREEDY)
    assert outputs[1].metrics.prefix_hit_tokens == 32
    assert llm.stats.steps == 2 + GREEDY.max_tokens - 1  # the second request waited one step
    cold = LLM(str(path), prefix_caching=PrefixCaching.OFF, **options).generate([first, second], GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in cold]


def test_preemption_and_resumption_keep_outputs(
    model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any]
) -> None:
    path = model_dir("qwen3_5")
    batch = prompts([45, 38, 50, 33, 41], seed=3)
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=24, block_size=4,
              kv_cache_memory_gib=26 * 4096 / 2**30)  # 26 blocks of 4 KiB for four groups
    outputs = llm.generate(batch, SamplingParams(max_tokens=10, eos=EosMode.IGNORE))
    assert llm.stats.preemptions > 0
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == hf_greedy(hf_model(path), prompt, 10)[0]


def test_state_pages_are_the_planned_padded_pages(model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(model_dir("qwen3_5")), **OPTIONS)
    config = llm.plan.config
    assert llm.kv_cache_bytes == config.total_bytes == llm.plan.config.num_blocks * config.page_size_bytes * 1 * len(
        config.tensors)
    for group in config.groups:
        if group.kind is not SpecKind.MAMBA:
            continue
        for layer in group.layer_indices:
            state = llm.runner.state_caches[layer]
            assert state is not None
            buffer = llm.runner.buffers[next(i for i, tensor in enumerate(config.tensors) if layer in tensor.shared_by)]
            conv, recurrent = state.conv, state.recurrent
            # block b's state starts at byte b * page of its tensor: conv first, the recurrent state after it
            assert conv.stride(0) * conv.element_size() == recurrent.stride(0) * recurrent.element_size() \
                == config.page_size_bytes
            assert conv.data_ptr() == buffer.data_ptr()
            assert recurrent.data_ptr() == buffer.data_ptr() + conv[0].numel() * conv.element_size()
            assert conv[0].numel() * conv.element_size() + recurrent[0].numel() * recurrent.element_size() \
                <= config.page_size_bytes
            assert tuple(conv.shape[1:]) == (3, 2 * 2 * 8 + 4 * 8)  # (conv_kernel - 1, q + k + v channels)
            assert tuple(recurrent.shape[1:]) == (4, 8, 8)  # (value heads, value dim, key dim)


def test_recurrent_state_keeps_mamba_ssm_dtype_under_a_bf16_model(
    model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """`mamba_ssm_dtype: float32` (as Qwen3.5 ships it): the conv state follows the model dtype (bf16),
    the recurrent state stays float32, both in one page, and generation still follows float32 closely."""
    import json
    import shutil

    path = tmp_path / "ssm_fp32"
    shutil.copytree(model_dir("qwen3_5"), path)
    config = json.loads((path / "config.json").read_text())
    config["mamba_ssm_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), dtype="bfloat16", **OPTIONS)
    layer = next(g for g in llm.plan.config.groups if g.kind is SpecKind.MAMBA).layer_indices[0]
    state = llm.runner.state_caches[layer]
    assert state is not None and state.conv.dtype == torch.bfloat16 and state.recurrent.dtype == torch.float32
    first, second = _shared_prefix(40)
    llm.generate([first], GREEDY)
    hit = llm.generate([second], GREEDY)[0]
    cold = LLM(str(path), dtype="bfloat16", prefix_caching=PrefixCaching.OFF, **OPTIONS).generate([second], GREEDY)[0]
    assert hit.metrics.prefix_hit_tokens == 32 and hit.token_ids[:4] == cold.token_ids[:4]
