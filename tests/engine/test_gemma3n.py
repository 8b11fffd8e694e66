"""Gemma 3n text in the engine against transformers: logits, greedy tokens and KV sharing.

A tiny random-weight `Gemma3nForCausalLM` (fp32) is saved in HF format. Its weights are redrawn
with std 0.2 (norm scales around 1): transformers' own init zeroes AltUp's `correct_output_scale`,
which would silence the per-layer inputs. Its 6 layers are

    layer      0        1        2      3        4      5
    type       sliding  sliding  full   sliding  full   sliding
    K/V        own      own      own    <- 1     <- 2   <- 1       (num_kv_shared_layers = 3)

so the sliding target (1) is not the last non-shared layer (2): a "read the layer just before"
bug would show. Layers 0 and 1 have sparse MLP activations; prompt ids >= 128 fall outside the
per-layer embedding table (vocab_size_per_layer_input < vocab_size).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.engine.attention import ScheduledChunk
from hybridkv.engine.llm import LLM
from hybridkv.engine.loader import load_model
from hybridkv.engine.models.base import CausalLM, ForwardContext
from hybridkv.engine.models.gemma3n import Gemma3nForCausalLM
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.errors import ConfigError
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import KVCacheConfig, PlannerOptions, build_kv_cache_config
from tests.engine.attention_helpers import build_group_metadata
from tests.engine.conftest import COMMON, WINDOW, hf_greedy, prompts, transformers

S, F = "sliding_attention", "full_attention"
BLOCK_SIZE = 4
TOLERANCE = 2e-3
NEW_TOKENS = 12
PROMPT_LENS = (21, 13, 34)  # all longer than the window (8), different lengths
SHARED_LAYERS = {3: 1, 4: 2, 5: 1}
TINY_GEMMA3N: dict[str, Any] = {
    **COMMON, "num_hidden_layers": 6, "layer_types": [S, S, F, S, F, S], "num_kv_shared_layers": 3,
    "sliding_window": WINDOW, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8,
    "laurel_rank": 8, "altup_num_inputs": 4, "activation_sparsity_pattern": [0.95, 0.5, 0.0, 0.0, 0.0, 0.0],
    "dtype": "float32", "architectures": ["Gemma3nForCausalLM"],
}


@pytest.fixture(scope="module")
def gemma3n_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the saved tiny Gemma 3n (built once)."""
    torch.manual_seed(0)
    model = transformers.Gemma3nForCausalLM(transformers.Gemma3nTextConfig(**TINY_GEMMA3N)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    path = tmp_path_factory.mktemp("gemma3n")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma3n_llm(gemma3n_dir: Path) -> LLM:
    """The engine with chunked prefill (16-token budget) and 4-token blocks."""
    return LLM(str(gemma3n_dir), max_model_len=128, max_num_batched_tokens=16, block_size=BLOCK_SIZE,
               kv_cache_memory_gib=0.01)


def _layout(model_dir: Path) -> tuple[CausalLM, KVCacheConfig]:
    model, config = load_model(model_dir, dtype=torch.float32)
    spec = model_spec_from_config(config, name="tiny-gemma3n")
    options = PlannerOptions(memory_bytes=1 << 20, max_model_len=128, block_size=BLOCK_SIZE)
    return model, build_kv_cache_config(spec, options)


def _prefill_logits(runner: ModelRunner, batch: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len, vocab] of every prompt position; the prompts are prefilled in one step.

    The runner only returns the last token's logits, so the step's ForwardContext is built here
    the way the runner builds it, with disjoint blocks per (group, request).
    """
    kv = runner.kv_config
    per_request = max(len(p) for p in batch) // BLOCK_SIZE + 1
    groups = []
    for g, group in enumerate(kv.groups):
        chunks = []
        for r, prompt in enumerate(batch):
            first = 1 + (g * len(batch) + r) * per_request  # block 0 is the null block
            chunks.append(ScheduledChunk(start_pos=0, end_pos=len(prompt),
                                         block_ids=list(range(first, first + per_request))))
        groups.append(build_group_metadata(chunks, rule=runner.rules[g], block_size=group.block_size))
    positions = torch.cat([torch.arange(len(p)) for p in batch])  # [T]
    ids = torch.tensor([t for p in batch for t in p])  # [T]
    ctx = ForwardContext(positions=positions, groups=groups, kv_caches=runner.kv_caches,
                         layer_group=runner.layer_group, kv_shared_from=kv.kv_shared_from)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(ids, positions, ctx))  # [T, vocab]
    ends = torch.tensor([len(p) for p in batch]).cumsum(0).tolist()
    return [logits[end - len(p) : end] for p, end in zip(batch, ends, strict=True)]


def test_prompt_logits_match_transformers(gemma3n_dir: Path, hf_model: Callable[[Path], Any]) -> None:
    batch = prompts(PROMPT_LENS)
    ours = _prefill_logits(ModelRunner(*_layout(gemma3n_dir)), batch)
    for prompt, logits in zip(batch, ours, strict=True):
        with torch.inference_mode():
            reference = hf_model(gemma3n_dir)(torch.tensor([prompt])).logits[0]  # [len, vocab]
        assert float((logits - reference).abs().max()) < TOLERANCE


def test_greedy_batch_with_chunked_prefill_matches_transformers(
    gemma3n_dir: Path, gemma3n_llm: LLM, hf_model: Callable[[Path], Any]
) -> None:
    batch = prompts(PROMPT_LENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, eos=EosMode.IGNORE, logprobs=5)
    outputs = gemma3n_llm.generate(batch, params)
    assert gemma3n_llm.stats.steps > NEW_TOKENS + 1  # the 34-token prompt needed several prefill steps
    for prompt, output in zip(batch, outputs, strict=True):
        expected, reference = hf_greedy(hf_model(gemma3n_dir), prompt, NEW_TOKENS)
        assert output.token_ids == expected
        for step, top in enumerate(output.logprobs):
            for token, logprob in top.items():
                assert abs(logprob - float(reference[step, token])) < TOLERANCE, (step, token)
    # Again: now the prompts hit the prefix cache; shared layers read their targets' cached blocks.
    again = gemma3n_llm.generate(batch, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    assert all(o.metrics.prefix_hit_tokens > 0 for o in again)


def test_sharing_targets_match_transformers(gemma3n_dir: Path, hf_model: Callable[[Path], Any]) -> None:
    config = hf_model(gemma3n_dir).config
    modes = config.kv_sharing_modes  # "reuse" layers read what the "store" layer of their type keeps
    store_of = {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    expected = {i: store_of[config.layer_types[i]] for i, mode in enumerate(modes) if mode == "reuse"}
    model, kv = _layout(gemma3n_dir)
    assert expected == SHARED_LAYERS
    assert kv.kv_shared_from == expected
    assert isinstance(model, Gemma3nForCausalLM) and model.kv_shared_from == expected


@pytest.mark.parametrize("layout_sharing", [{}, {3: 1, 4: 2, 5: 0}])
def test_runner_rejects_a_layout_whose_kv_sharing_differs_from_the_model(
    gemma3n_dir: Path, layout_sharing: dict[int, int]
) -> None:
    """Checked when the runner is built, not at the first forward."""
    model, kv = _layout(gemma3n_dir)
    wrong = dataclasses.replace(kv, kv_shared_from=layout_sharing)
    expected = re.escape(f"layout shares {layout_sharing}") + ".*" + re.escape(f"computes {SHARED_LAYERS}")
    with pytest.raises(ConfigError, match=expected):
        ModelRunner(model, wrong)


def test_kv_shared_layers_own_no_memory(gemma3n_llm: LLM) -> None:
    kv, runner = gemma3n_llm.plan.config, gemma3n_llm.runner
    owners = {layer for tensor in kv.tensors for layer in tensor.shared_by}
    grouped = {layer for group in kv.groups for layer in group.layer_indices}
    assert owners == grouped == {0, 1, 2}
    assert gemma3n_llm.kv_cache_bytes == kv.total_bytes
    for layer, target in SHARED_LAYERS.items():
        assert runner.kv_caches[layer].data_ptr() == runner.kv_caches[target].data_ptr()
        assert runner.layer_group[layer] == runner.layer_group[target]


def test_multimodal_wrapper_config_loads_the_text_model(gemma3n_dir: Path, tmp_path: Path) -> None:
    """A `gemma3n` config with `text_config` and `model.language_model.*` weights gives the same model."""
    text = json.loads((gemma3n_dir / "config.json").read_text())
    wrapper = {"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"], "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    weights = {name.replace("model.", "model.language_model.", 1): tensor
               for name, tensor in load_file(gemma3n_dir / "model.safetensors").items()}
    weights["model.vision_tower.stub.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors")
    batch = prompts(PROMPT_LENS[:1])
    wrapped = _prefill_logits(ModelRunner(*_layout(tmp_path)), batch)[0]
    plain = _prefill_logits(ModelRunner(*_layout(gemma3n_dir)), batch)[0]
    assert torch.equal(wrapped, plain)
