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
from safetensors import safe_open

from hybridkv.core.errors import ConfigError
from hybridkv.core.model_specs import load_config
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.models.registry import model_class

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
    """The weight files of `model_dir`; raises ConfigError when there are none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return sorted({model_dir / name for name in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {model_dir}; expected an HF-format model directory")
    return files


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every weight file, read lazily."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, handle.get_tensor(name)


def load_model(model_dir: Path, *, dtype: torch.dtype) -> tuple[CausalLM, dict[str, Any]]:
    """(model with weights loaded, full config dict) of an HF-format directory."""
    config = load_config(model_dir)
    cls = model_class(config)
    with torch.device("cpu"):
        model = cls(config).to(dtype)
    model.load_weights(iter_weights(model_dir))
    model.eval()
    return model, config
