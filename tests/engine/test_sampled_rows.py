"""The last decoder layer computes its MLP for the step's sampled rows only.

Every step's tokens reach the first layers' MLPs; the last layer's MLP sees one row per item
that samples (a prefill chunk that does not end its prompt samples nothing). The outputs of
these runs equal transformers' (test_models_vs_transformers.py runs the same batches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridkv.engine.llm import LLM
from hybridkv.engine.models.decoder import DecoderForCausalLM
from hybridkv.engine.runner import StepItem
from hybridkv.engine.sampler import EosMode, SamplingParams
from tests.engine.conftest import prompts


def _mlp(layer: nn.Module) -> nn.Module:
    mlp = getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)
    assert isinstance(mlp, nn.Module)
    return mlp


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss", "mistral", "qwen3_5"])
def test_last_layer_mlp_runs_on_sampled_rows_only(kind: str, model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(model_dir(kind)), max_model_len=256, max_num_batched_tokens=40, block_size=4,
              kv_cache_memory_gib=0.01)
    model = llm.runner.model
    assert isinstance(model, DecoderForCausalLM)
    layers = list(model.model.layers)
    assert getattr(layers[-1], "narrows_to_sample_rows", False)
    seen: dict[str, list[int]] = {"first": [], "last": []}
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        _mlp(layer).register_forward_pre_hook(lambda _m, args, name=name: seen[name].append(args[0].shape[0]))
    expected_first: list[int] = []
    expected_last: list[int] = []
    execute = llm.runner.execute

    def recording(items: Sequence[StepItem]) -> torch.Tensor:
        expected_first.append(sum(len(it.token_ids) for it in items))
        expected_last.append(sum(it.sample for it in items))
        return execute(items)

    llm.runner.execute = recording  # type: ignore[method-assign]
    llm.generate(prompts([57, 23, 41, 30]), SamplingParams(max_tokens=3, eos=EosMode.IGNORE))
    assert seen["first"] == expected_first
    assert seen["last"] == expected_last
    assert any(t > n for t, n in zip(expected_first, expected_last, strict=True))  # prefill steps were narrowed
    assert 0 in expected_last  # a chunk that samples nothing: the last MLP ran on no rows
