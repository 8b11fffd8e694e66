"""Which model class serves a checkpoint: by `architectures`, else by `model_type`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.engine.models.bamba import BambaForCausalLM
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.models.deepseek import DeepseekForCausalLM
from hybridkv.engine.models.falcon_h1 import FalconH1ForCausalLM
from hybridkv.engine.models.gemma3 import Gemma3ForCausalLM
from hybridkv.engine.models.gemma3n import Gemma3nForCausalLM
from hybridkv.engine.models.gpt_oss import GptOssForCausalLM
from hybridkv.engine.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from hybridkv.engine.models.jamba import JambaForCausalLM
from hybridkv.engine.models.kimi_linear import KimiLinearForCausalLM
from hybridkv.engine.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from hybridkv.engine.models.llama4 import Llama4ForCausalLM
from hybridkv.engine.models.llama_like import LlamaLikeForCausalLM
from hybridkv.engine.models.nemotron_h import NemotronHForCausalLM
from hybridkv.engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from hybridkv.engine.models.qwen3_next import Qwen3NextForCausalLM
from hybridkv.errors import UnsupportedModelError

MODEL_CLASSES: tuple[type[CausalLM], ...] = (
    Gemma3ForCausalLM, GptOssForCausalLM, Llama4ForCausalLM, LlamaLikeForCausalLM, Gemma3nForCausalLM,
    Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM,
    DeepseekForCausalLM,
    BambaForCausalLM, GraniteMoeHybridForCausalLM, NemotronHForCausalLM, FalconH1ForCausalLM, JambaForCausalLM,
    Lfm2ForCausalLM, Lfm2MoeForCausalLM, KimiLinearForCausalLM,
)
_BY_ARCHITECTURE: dict[str, type[CausalLM]] = {arch: cls for cls in MODEL_CLASSES for arch in cls.architectures}
_BY_MODEL_TYPE: dict[str, type[CausalLM]] = {
    "gemma3_text": Gemma3ForCausalLM, "gpt_oss": GptOssForCausalLM, "llama4_text": Llama4ForCausalLM,
    "llama": LlamaLikeForCausalLM, "mistral": LlamaLikeForCausalLM, "qwen2": LlamaLikeForCausalLM,
    "smollm3": LlamaLikeForCausalLM,
    "gemma3n_text": Gemma3nForCausalLM, "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM, "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM, "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "deepseek_v3": DeepseekForCausalLM, "kimi_k2": DeepseekForCausalLM, "deepseek_v32": DeepseekForCausalLM,
    "glm_moe_dsa": DeepseekForCausalLM,
    "bamba": BambaForCausalLM, "granitemoehybrid": GraniteMoeHybridForCausalLM, "nemotron_h": NemotronHForCausalLM,
    "falcon_h1": FalconH1ForCausalLM, "jamba": JambaForCausalLM, "lfm2": Lfm2ForCausalLM,
    "lfm2_moe": Lfm2MoeForCausalLM,
    "kimi_linear": KimiLinearForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def model_class(config: Mapping[str, Any]) -> type[CausalLM]:
    """The class for an HF config dict; raises UnsupportedModelError listing the supported ones."""
    for arch in config.get("architectures") or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    if not config.get("architectures") and config.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[str(config["model_type"])]
    raise UnsupportedModelError(
        f"unsupported architecture {config.get('architectures')} (model_type {config.get('model_type')!r}); "
        f"the engine supports: {', '.join(supported_architectures())}"
    )
