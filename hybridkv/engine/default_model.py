"""The embedded default model: a tiny random-weight Gemma 3 text, built once and cached on disk.

Its weights are drawn from a fixed seed, so every machine builds the same model; it is saved in
HF format (config.json + model.safetensors) under `<cache>/default-gemma3-<config hash>` and then
loaded through the normal loader, like any downloaded model. Its vocabulary is the byte-level
tokenizer's, saved with it in HF format (tokenizer.json + tokenizer_config.json: pass the
directory as `--tokenizer` to tools that need one), so text prompts work, but the weights are
random: **its text is meaningless**. It exists to exercise the hybrid KV cache (5 sliding-window
layers, 1 full layer) end to end.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hybridkv.engine.config import DEFAULT_MODEL_NAME
from hybridkv.engine.models.gemma3 import Gemma3ForCausalLM
from hybridkv.engine.tokenizer import BOS_ID, BYTE_VOCAB, EOS_ID, PAD_ID, save_byte_tokenizer

MEANINGLESS_NOTE = "the embedded default model has random weights: its generated text is meaningless"
INIT_STD = 0.2
SEED = 0

DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "dtype": "float32",
    "vocab_size": BYTE_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 64,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "tie_word_embeddings": False,
    "pad_token_id": PAD_ID,
    "eos_token_id": EOS_ID,
    "bos_token_id": BOS_ID,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "initializer_range": INIT_STD,
}


def cache_root() -> Path:
    """`$HYBRIDKV_CACHE_DIR`, else `~/.cache/hybridkv`."""
    env = os.environ.get("HYBRIDKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hybridkv"


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def random_state_dict(config: dict[str, Any], *, seed: int = SEED, std: float = INIT_STD) -> dict[str, torch.Tensor]:
    """HF-named random weights: normal(0, std) for matrices, zeros for the (1 + w) norms."""
    model = Gemma3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            state[name] = torch.zeros(param.shape)
        else:
            state[name] = torch.randn(param.shape, generator=generator) * std
    return state


def ensure_default_model(root: Path | None = None) -> Path:
    """Directory of the default model, building it on first use (atomic rename, safe to race)."""
    target = (root or cache_root()) / f"{DEFAULT_MODEL_NAME}-{config_hash(DEFAULT_CONFIG)}"
    if (target / "model.safetensors").is_file():
        if not (target / "tokenizer_config.json").is_file():  # built before the tokenizer was saved with it
            _add_tokenizer(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        (staging / "config.json").write_text(json.dumps(DEFAULT_CONFIG, indent=2), encoding="utf-8")
        save_byte_tokenizer(staging)
        save_file(random_state_dict(DEFAULT_CONFIG), str(staging / "model.safetensors"))
        (staging / "README.txt").write_text(
            f"{MEANINGLESS_NOTE}.\nBuilt by hybridkv from seed {SEED}, init std {INIT_STD}.\n", encoding="utf-8")
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _add_tokenizer(target: Path) -> None:
    """Save the tokenizer files into an existing model directory, each by an atomic rename."""
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        save_byte_tokenizer(staging)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the config last: it marks the pair complete
            os.replace(staging / name, target / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
