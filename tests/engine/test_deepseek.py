"""DeepSeek-V3 MLA and DeepSeek-V3.2 / GLM-5 DSA in our engine, token for token against transformers.

Tiny random models (fp32, init std 0.2) with a MoE layer after a dense one. The sparse models run
with vLLM's layout: latents and indexer keys in one group of mixed pages, block size 64 (forced by
the sparse MLA kernels), so prompts of 100-200 tokens span several blocks; a 48-token budget cuts
them into chunks. `index_topk` 8 keeps far fewer keys than the context (the selection matters: a
guard test shows the output changes when it is widened); 512 keeps them all.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.cache_server.store import StoreConfig
from hybridkv.engine.attention import AttentionRule, GroupMetadata, ScheduledChunk
from hybridkv.engine.llm import LLM
from hybridkv.engine.mla_attention import dsa_select, latent_view
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.errors import ConfigError
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import IndexerSpec, MLAFormat, MLASpec, SpecKind
from tests.engine.attention_helpers import build_group_metadata
from tests.engine.conftest import VOCAB, hf_greedy, prompts

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
TOLERANCE = 2e-3
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, initializer_range=0.2,
    max_position_embeddings=512, eos_token_id=1, bos_token_id=2, pad_token_id=0,
)
_DSA: dict[str, Any] = dict(index_head_dim=16, index_n_heads=8, index_topk=8)


def _config(kind: str) -> Any:
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(**_COMMON, architectures=["DeepseekV3ForCausalLM"])
    if kind == "deepseek_v32":
        return transformers.DeepseekV32Config(**_COMMON, **_DSA, architectures=["DeepseekV32ForCausalLM"])
    if kind == "deepseek_v32_wide":
        return transformers.DeepseekV32Config(**_COMMON, **(_DSA | {"index_topk": 512}),
                                              architectures=["DeepseekV32ForCausalLM"])
    if kind == "glm_moe_dsa":  # layers 0, 1 run their indexer, layer 2 reuses layer 1's selection
        return transformers.GlmMoeDsaConfig(**(_COMMON | {"qk_nope_head_dim": 8}), **_DSA, index_topk_freq=2,
                                            architectures=["GlmMoeDsaForCausalLM"])
    raise ValueError(kind)


KINDS = ("deepseek_v3", "deepseek_v32", "deepseek_v32_wide", "glm_moe_dsa")


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(_config(kind)).float().eval()
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            built[kind] = path
        return built[kind]

    return make


def _engine(path: Path, **options: Any) -> LLM:
    return LLM(str(path), **({"max_model_len": 512, "max_num_batched_tokens": 48, "kv_cache_memory_gib": 0.05}
                             | options))


def _check(llm: LLM, hf: Any, batch: list[list[int]], where: str) -> list[list[int]]:
    outputs = llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, eos=EosMode.IGNORE, logprobs=5))
    for prompt, output in zip(batch, outputs, strict=True):
        expected, reference = hf_greedy(hf, prompt, NEW_TOKENS)
        assert output.token_ids == expected, where
        for step, top in enumerate(output.logprobs):
            for token, logprob in top.items():
                assert abs(logprob - float(reference[step, token])) < TOLERANCE, (where, step, token)
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_chunked_prefill_and_prefix_hits_match_transformers(
    kind: str, deepseek_dir: Callable[[str], Path], hf_model: Callable[[Path], Any]
) -> None:
    path = deepseek_dir(kind)
    hf = hf_model(path)
    llm = _engine(path)
    sparse = kind != "deepseek_v3"
    (group,) = llm.plan.config.groups
    assert group.block_size == (64 if sparse else 16) and group.mixed_pages is sparse
    batch = prompts([150, 37, 101], seed=3)
    _check(llm, hf, batch, kind)
    assert llm.stats.steps > NEW_TOKENS + 4  # the 150-token prompt took several prefill chunks
    shared = batch[0][:140]
    again = [shared + prompts([20], seed=4)[0], shared + prompts([9], seed=5)[0]]
    outputs = llm.generate(again, SamplingParams(max_tokens=NEW_TOKENS, eos=EosMode.IGNORE))
    hits = [o.metrics.prefix_hit_tokens for o in outputs]
    block = group.block_size
    assert all(h >= (140 // block) * block for h in hits), hits  # the shared prefix's full blocks were reused
    for prompt, output in zip(again, outputs, strict=True):
        assert output.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)[0], kind


def test_top_k_narrower_than_the_context_changes_the_output(deepseek_dir: Callable[[str], Path],
                                                            tmp_path: Path) -> None:
    """Guards the comparison: with top-8 selection the tokens differ from attending to all keys."""
    narrow = deepseek_dir("deepseek_v32")
    wide = tmp_path / "wide"
    shutil.copytree(narrow, wide)
    config = json.loads((wide / "config.json").read_text())
    config["index_topk"] = 512
    (wide / "config.json").write_text(json.dumps(config))
    prompt = prompts([120], seed=6)[0]
    params = SamplingParams(max_tokens=1, logprobs=1)
    (narrow_token, narrow_lp), = _engine(narrow).generate([prompt], params)[0].logprobs[0].items()
    (wide_token, wide_lp), = _engine(wide).generate([prompt], params)[0].logprobs[0].items()
    assert narrow_token != wide_token or abs(narrow_lp - wide_lp) > 100 * TOLERANCE


def test_latent_views_and_packed_formats() -> None:
    mla = MLASpec(kv_lora_rank=32, qk_rope_head_dim=8, dtype="float32")
    group = KVCacheGroupSpec(group_id=0, spec=mla, layer_indices=(0,), block_size=4)
    view = latent_view(torch.zeros(3 * 4 * 40 * 4, dtype=torch.uint8), mla, group=group, num_blocks=3,
                       dtype=torch.float32)
    assert view.shape == (3, 4, 40) and view.dtype == torch.float32
    packed = MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16", cache_format=MLAFormat.FP8_DS_MLA)
    for spec in (packed, IndexerSpec(entry_size=132, dtype="uint8")):
        with pytest.raises(ConfigError, match="packed"):
            latent_view(torch.zeros(3 * 4 * 656, dtype=torch.uint8), spec, group=group, num_blocks=3,
                        dtype=torch.bfloat16)


def _one_row_metadata(num_keys: int) -> GroupMetadata:
    """A decode of position num_keys - 1 whose keys sit in blocks 1, 2, ... of 4 tokens."""
    table = list(range(1, num_keys // 4 + 2))
    return build_group_metadata([ScheduledChunk(start_pos=num_keys - 1, end_pos=num_keys, block_ids=table)],
                                rule=AttentionRule(kind=SpecKind.FULL), block_size=4)


@pytest.mark.parametrize(("topk", "expected"), [(2, [3, 6]), (3, [1, 3, 6]), (100, list(range(8)))])
def test_dsa_selection_by_hand(topk: int, expected: list[int]) -> None:
    """One index head, weight 1, keys whose dot products with the query are known: the top-k keys are
    kept; a top-k wider than the 8 visible keys keeps all of them (and nothing beyond them)."""
    meta = _one_row_metadata(8)
    cache = torch.zeros(5, 4, 2)  # [blocks, block_size, index dim]
    dots = torch.tensor([0.1, 0.5, -1.0, 0.9, 0.0, 0.2, 0.7, -0.3])  # q . k of keys 0..7 (q = (1, 0))
    flat = cache.view(-1, 2)
    flat[4:12, 0] = dots  # blocks 1 and 2 hold positions 0..7
    flat[12:, 0] = 5.0  # slots of later blocks must never be chosen
    (chosen,) = dsa_select(torch.tensor([[[1.0, 0.0]]]), torch.ones(1, 1), cache, meta, topk=topk, scale=1.0)
    assert chosen.shape[-1] >= 8 and chosen[0, 0, 0].nonzero().flatten().tolist() == expected


def test_multi_token_prediction_layers_in_the_checkpoint_are_ignored(deepseek_dir: Callable[[str], Path],
                                                                    tmp_path: Path) -> None:
    """Released DeepSeek checkpoints carry the MTP module as `model.layers.<num_hidden_layers>`."""
    from safetensors.torch import load_file, save_file

    mtp = tmp_path / "mtp"
    shutil.copytree(deepseek_dir("deepseek_v3"), mtp)
    weights = load_file(mtp / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, mtp / "model.safetensors", metadata={"format": "pt"})
    prompt = prompts([30], seed=7)[0]
    params = SamplingParams(max_tokens=3, eos=EosMode.IGNORE)
    assert _engine(mtp).generate([prompt], params)[0].token_ids == _engine(
        deepseek_dir("deepseek_v3")).generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_kv_server_procedure_with_a_group_of_mixed_pages(kind: str, deepseek_dir: Callable[[str], Path],
                                                         hf_model: Callable[[Path], Any]) -> None:
    """Latents and indexer keys (pages of two sizes in one group) stored and loaded through the KV cache
    server: run, clear only the local prefix cache, run again; the same tokens as the first run and
    transformers, whole 64-token chunks loaded from the server."""
    from tests.cache_server.helpers import running_server
    from tests.engine.test_kv_connector import GREEDY, check, procedure

    path = deepseek_dir(kind)
    batch = prompts([150, 101, 70], seed=7)
    with running_server(StoreConfig(chunk_tokens=64, l1_bytes=1 << 26)) as server, \
            _engine(path, kv_server=server.endpoint) as llm:
        assert llm.transfer is not None and llm.plan.config.groups[0].mixed_pages
        first, second = procedure(llm, server, batch)
        check(first, second, server, ["full"])
        assert [o.metrics.external_hit_tokens for o in second] == [128, 64, 64]  # whole chunks before the last token
    hf = hf_model(path)
    for prompt, out in zip(batch, second, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)[0], kind
