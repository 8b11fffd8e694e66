"""Our rotary frequencies equal transformers' for every rope type and config format we read."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridkv.engine.models.layers import inverse_frequencies, rope_parameters

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
