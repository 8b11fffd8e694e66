"""Our rotary frequencies equal transformers' for every rope type and config format we read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.engine.loader import load_model
from hybridkv.engine.models.layers import RopeLayout, RotaryEmbedding, inverse_frequencies, rope_parameters
from tests.engine.conftest import ARCHITECTURES
from tests.engine.test_gemma3n import TINY_GEMMA3N

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
          "original_max_position_embeddings": 8192, "rope_theta": 500000.0}


@pytest.mark.parametrize(("config", "layer_type"), [
    (transformers.GptOssConfig(head_dim=64, rope_parameters={**YARN, "truncate": False}), None),
    (transformers.GptOssConfig(head_dim=64, rope_parameters={**YARN, "truncate": True}), None),
    (transformers.Llama4TextConfig(head_dim=128, rope_parameters=LLAMA3), None),
    (transformers.Gemma3TextConfig(head_dim=32, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "full_attention"),
])
def test_inverse_frequencies_match_transformers(config: Any, layer_type: str | None) -> None:
    params = rope_parameters(config.to_dict(), layer_type=layer_type, default_theta=1.0)
    ours, our_scale = inverse_frequencies(params, dim=config.head_dim, max_positions=config.max_position_embeddings)
    theirs, their_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, layer_type=layer_type)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(their_scale)


def test_legacy_gemma3_fields_give_local_and_scaled_global_rope() -> None:
    legacy = {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert rope_parameters(legacy, layer_type="sliding_attention", default_theta=1e4) == {
        "rope_theta": 1e4, "rope_type": "default"}
    assert rope_parameters(legacy, layer_type="full_attention", default_theta=1e6) == {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def test_rotary_embedding_cast_to_bf16_keeps_float32_frequencies() -> None:
    """`inv_freq` is no buffer, so `.to(dtype)` of a module holding the rope does not round it."""
    params = rope_parameters({}, layer_type=None, default_theta=10000.0)
    holder = torch.nn.Module()
    holder.rope = RotaryEmbedding(params, dim=64, max_positions=4096, layout=RopeLayout.HALVES)
    expected = holder.rope.inv_freq.clone()
    holder.to(torch.bfloat16)
    assert holder.rope.inv_freq.dtype == torch.float32 and torch.equal(holder.rope.inv_freq, expected)


def _bf16_model_dir(kind: str, model_dir: Callable[[str], Path], tmp_path: Path) -> Path:
    if kind != "gemma3n":
        return model_dir(kind)
    transformers.Gemma3nForCausalLM(transformers.Gemma3nTextConfig(**TINY_GEMMA3N)).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("kind", [*ARCHITECTURES, "gemma3n"])
def test_bf16_models_keep_float32_frequencies(kind: str, model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """Casting a model to bf16 (as the loader does) leaves its rotary frequencies fp32 and unrounded:
    angles at position 4000 stay exact to fp32 rounding (~2e-4 rad), where bf16 frequencies
    (8 mantissa bits) would be off by radians."""
    path = _bf16_model_dir(kind, model_dir, tmp_path)
    model, _ = load_model(path, dtype=torch.bfloat16)
    reference, _ = load_model(path, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.ropes.keys() == reference.ropes.keys() != set()
    position = 4000
    for kind_, rope in model.ropes.items():
        expected = reference.ropes[kind_].inv_freq
        assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, expected)
        angles = position * expected.double()  # [D/2]
        cos, sin = rope.cos_sin(torch.tensor([position]))  # [1, 1, D/2] each
        assert cos.dtype == sin.dtype == torch.float32
        torch.testing.assert_close(cos[0, 0].double(), angles.cos() * rope.attention_scaling, rtol=0, atol=1e-3)
        torch.testing.assert_close(sin[0, 0].double(), angles.sin() * rope.attention_scaling, rtol=0, atol=1e-3)
