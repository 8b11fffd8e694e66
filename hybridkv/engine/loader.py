"""Load an HF-format model directory: config.json + *.safetensors (HF weight names).

    model_dir/config.json                          -> model class (registry) + ModelSpec (core)
    model_dir/model.safetensors                    -> weights, or
    model_dir/model.safetensors.index.json + shards
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.models.registry import model_class
from hybridkv.errors import ConfigError
from hybridkv.plan.model_specs import load_config

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an engine dtype name; raises ConfigError listing the supported ones."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported engine dtype {name!r}; expected one of {sorted(TORCH_DTYPES)}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of `model_dir`; raises ConfigError when there are none or one is missing."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise ConfigError(f"cannot read weight index {index}: {exc}; expected a JSON object with "
                              "a 'weight_map'") from None
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {model_dir}; expected an HF-format model directory")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"weight file(s) {missing} listed in {index.name} are missing from {model_dir}")
    return files


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every weight file, read lazily.

    A truncated or corrupt file raises ConfigError naming it (not safetensors' own error).
    """
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"weight file {file} is corrupt or incomplete ({exc}); "
                              "expected a complete .safetensors file: download or save it again") from None


def load_model(model_dir: Path, *, dtype: torch.dtype) -> tuple[CausalLM, dict[str, Any]]:
    """(model with weights loaded, full config dict) of an HF-format directory."""
    config = load_config(model_dir)
    cls = model_class(config)
    with torch.device("cpu"):
        model = cls(config).to(dtype)
    model.load_weights(iter_weights(model_dir))
    model.eval()
    return model, config
