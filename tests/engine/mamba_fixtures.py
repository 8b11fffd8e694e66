"""Tiny random-weight Mamba hybrids (fp32, init std 0.2): Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1, Jamba.

Their states are small enough that the planner gives them 16-token blocks (one attention page
holds a state), so 40-60-token prompts cross several block boundaries. Multipliers are set away
from 1 so a forgotten one shows. The reference drops transformers' dt clamp (its Mamba2 mixers
clamp dt only on the chunked path, Nemotron-H at `time_step_min`): `time_step_limit = (0, inf)`
on every mixer of the reference model, which is also what our engine reads from these configs.

Test modules import the fixtures `mamba_dir` and `mamba_hf`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.conftest import COMMON

transformers = pytest.importorskip("transformers")

MAMBA2: dict[str, Any] = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                              mamba_expand=1, mamba_chunk_size=16)
MULTIPLIERS: dict[str, Any] = dict(  # Falcon-H1's muP multipliers
    embedding_multiplier=1.3, lm_head_multiplier=0.8, key_multiplier=0.9, attention_in_multiplier=1.1,
    attention_out_multiplier=0.7, ssm_in_multiplier=1.2, ssm_out_multiplier=0.6,
    ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], mlp_multipliers=[1.2, 0.9])
BASE = {k: v for k, v in COMMON.items() if k != "num_hidden_layers"}


def mamba_config(kind: str) -> Any:
    if kind == "bamba":
        return transformers.BambaConfig(**BASE, **MAMBA2, num_hidden_layers=4, attn_layer_indices=[1],
                                        architectures=["BambaForCausalLM"])
    if kind == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(
            **BASE, **MAMBA2, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
            num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=80, position_embedding_type="rope",
            embedding_multiplier=1.5, logits_scaling=2.0, residual_multiplier=0.7, attention_multiplier=0.2,
            architectures=["GraniteMoeHybridForCausalLM"])
    if kind == "nemotron_h":
        return transformers.NemotronHConfig(
            **BASE, layers_block_type=["mamba", "moe", "attention", "mlp", "mamba"], mamba_num_heads=4,
            mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=48, moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
            routed_scaling_factor=1.5, architectures=["NemotronHForCausalLM"])
    if kind in ("falcon_h1", "falcon_h1_plain"):  # plain: no gated RMSNorm (the released models' default)
        norm = dict(mamba_rms_norm=True, mamba_norm_before_gate=False) if kind == "falcon_h1" else {}
        return transformers.FalconH1Config(**BASE, **{**MAMBA2, "mamba_expand": 2}, mamba_d_ssm=64,
                                           num_hidden_layers=3, **norm, **MULTIPLIERS,
                                           architectures=["FalconH1ForCausalLM"])
    if kind == "jamba":
        return transformers.JambaConfig(
            **BASE, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=1, mamba_dt_rank=8, architectures=["JambaForCausalLM"])
    raise ValueError(kind)


MAMBA_KINDS = ("bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "falcon_h1_plain", "jamba")


def without_dt_clamp(model: Any) -> Any:
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, math.inf)
    return model


@pytest.fixture(scope="session")
def mamba_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """kind -> directory of a saved tiny random Mamba hybrid (built once)."""
    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(mamba_config(kind)).float().eval()
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            built[kind] = path
        return built[kind]

    return make


@pytest.fixture(scope="session")
def mamba_hf(mamba_dir: Callable[[str], Path]) -> Callable[[str], Any]:
    """kind -> the transformers reference model of `mamba_dir(kind)`, dt clamp off."""
    loaded: dict[str, Any] = {}

    def load(kind: str) -> Any:
        if kind not in loaded:
            model = transformers.AutoModelForCausalLM.from_pretrained(mamba_dir(kind), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            loaded[kind] = without_dt_clamp(model)
        return loaded[kind]

    return load
