"""Tiny random-weight HF checkpoints (fp32, init std 0.2) of every supported architecture.

Each factory saves a model with `save_pretrained` to a session temp dir once; tests load it both
through transformers (the reference) and through our engine. Windows are 8 tokens and chunks 16,
so prompts of 20-60 tokens cross them several times. The Gated DeltaNet hybrids (Qwen3.5 dense,
MoE and multimodal, Qwen3-Next) have a state that makes their blocks 16 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 160
WINDOW = 8
CHUNK = 16
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, initializer_range=0.2, max_position_embeddings=512,
    eos_token_id=1, bos_token_id=2, pad_token_id=0,
)


def _config(kind: str) -> Any:
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **COMMON, sliding_window=WINDOW, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            architectures=["Gemma3ForCausalLM"])
    if kind == "gpt_oss":
        return transformers.GptOssConfig(
            **COMMON, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.5,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 1000.0},
            architectures=["GptOssForCausalLM"])
    if kind == "llama4":
        return transformers.Llama4TextConfig(
            **COMMON, attention_chunk_size=CHUNK, num_local_experts=4, num_experts_per_tok=1,
            intermediate_size_mlp=80, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1],
            floor_scale=8, attn_scale=0.5, architectures=["Llama4ForCausalLM"])
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW, architectures=["MistralForCausalLM"])
    if kind == "smollm3":  # layer_types: the NoPE layers (1 and 3) slide, the rope layers are full
        return transformers.SmolLM3Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                          no_rope_layer_interval=2, architectures=["SmolLM3ForCausalLM"])
    return _state_config(kind)


GATED_DELTANET: dict[str, Any] = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48)
TINY_VISION: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                   patch_size=4, num_position_embeddings=16)


def _state_config(kind: str) -> Any:
    if kind == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**COMMON, **GATED_DELTANET, architectures=["Qwen3_5ForCausalLM"])
    if kind == "qwen3_5_moe":
        dense = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
        return transformers.Qwen3_5MoeTextConfig(**dense, **GATED_DELTANET, **MOE,
                                                 architectures=["Qwen3_5MoeForCausalLM"])
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(**COMMON, **GATED_DELTANET, **MOE, mlp_only_layers=[1],
                                            architectures=["Qwen3NextForCausalLM"])
    if kind == "lfm2":  # short convolutions (kernel 3) with attention at layers 1 and 3
        return transformers.Lfm2Config(**COMMON, conv_L_cache=3, layer_types=["conv", "full_attention"] * 2,
                                       norm_eps=1e-5, architectures=["Lfm2ForCausalLM"])
    if kind == "lfm2_moe":  # LFM2 with sigmoid-routed experts (expert bias) from layer 1 on
        dense = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
        return transformers.Lfm2MoeConfig(**dense, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                          num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=1.5,
                                          conv_L_cache=3, layer_types=["conv", "full_attention"] * 2, norm_eps=1e-5,
                                          architectures=["Lfm2MoeForCausalLM"])
    if kind == "kimi_linear":  # KDA at layers 0, 1, 3; MLA (no rope) at layer 2; MoE at layers 1 and 3
        mla = dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        return transformers.KimiLinearConfig(
            **{**COMMON, "num_key_value_heads": 4}, **mla, linear_num_heads=4, linear_head_dim=16,
            linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "dense", "sparse"], num_local_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            architectures=["KimiLinearForCausalLM"])
    if kind == "qwen3_5_vl":
        return transformers.Qwen3_5Config(text_config={**COMMON, **GATED_DELTANET}, vision_config=TINY_VISION,
                                          architectures=["Qwen3_5ForConditionalGeneration"])
    raise ValueError(kind)


ARCHITECTURES = ("gemma3", "gpt_oss", "llama4", "mistral", "smollm3")
STATE_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl", "lfm2", "lfm2_moe", "kimi_linear")


def _hf_class(config: Any) -> Any:
    """The transformers class of a config: the multimodal wrapper for Qwen3.5-VL, else the causal LM."""
    if isinstance(config, transformers.Qwen3_5Config):
        return transformers.Qwen3_5ForConditionalGeneration
    return transformers.AutoModelForCausalLM


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared 2-core machine spinning OpenMP
    threads that lose their core slow every op down by an order of magnitude."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """kind -> directory of a saved tiny random model of that architecture (built once)."""
    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            torch.manual_seed(0)
            config = _config(kind)
            cls = _hf_class(config)
            model = (cls(config) if cls is not transformers.AutoModelForCausalLM
                     else cls.from_config(config)).float().eval()
            for name, buffer in model.named_buffers():  # LFM2-MoE's expert bias starts at 0: make it choose
                if name.endswith("expert_bias"):
                    buffer.copy_(torch.randn(buffer.shape))
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            built[kind] = path
        return built[kind]

    return make


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], Any]:
    loaded: dict[Path, Any] = {}

    def load(path: Path) -> Any:
        if path not in loaded:
            config = transformers.AutoConfig.from_pretrained(path)
            model = _hf_class(config).from_pretrained(path, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            loaded[path] = model
        return loaded[path]

    return load


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (batch of one, no padding) and their log-softmax rows [n, vocab]."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return tokens, logprobs


def prompts(lengths: Sequence[int], *, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
