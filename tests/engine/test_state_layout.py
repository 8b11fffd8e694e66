"""The multi-page state layout in the engine: states gathered from and scattered to k pages give the
same greedy tokens as the one-page layout and as transformers, with prefix hits the one-page layout
cannot have.

The tiny models' one-page state block is 16 tokens (block size 4 raised until one attention page holds
a state); in the multi-page layout attention keeps 4-token blocks and a state spans several pages,
so a prefix shared up to a 4-token boundary hits there (align mode: a checkpoint where a step ends).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from hybridkv.cache_server.store import StoreConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.manager import PrefixCaching
from hybridkv.plan.planner import StateLayout
from tests.cache_server.helpers import running_server
from tests.engine.conftest import COMMON, GATED_DELTANET, hf_greedy, prompts
from tests.engine.mamba_fixtures import mamba_dir, mamba_hf  # noqa: F401 (fixtures)
from tests.engine.test_kv_connector import retrieved

GREEDY = SamplingParams(max_tokens=8, eos=EosMode.IGNORE, logprobs=1)
OPTIONS: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=40, block_size=4, kv_cache_memory_gib=0.02)


def _run(path: Path, layout: StateLayout, batch: list[list[int]], **options: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(str(path), state_layout=layout, **{**OPTIONS, **options})
    return llm, [llm.generate([prompt], GREEDY)[0] for prompt in batch]


def _check(path: Path, hf: Any) -> None:
    first, tail = prompts([70, 13], seed=7)
    second = first[:44] + tail  # shares 44 tokens: 11 blocks of 4, never a multiple of 16 past 32
    multi, (a, b) = _run(path, StateLayout.MULTI_PAGE, [first, second])
    assert multi.plan.config.pages_per_state > 1
    one, (c, d) = _run(path, StateLayout.ONE_PAGE, [first, second])
    assert one.plan.config.pages_per_state == 1
    # align mode: the first prompt's chunks end at 40 and 70, so its checkpoints are at 40 tokens
    # (multi-page: a 4-token boundary) and at 32 in the one-page layout (chunks cut at 16-token blocks)
    assert (b.metrics.prefix_hit_tokens, d.metrics.prefix_hit_tokens) == (40, 32)
    cold = LLM(str(path), prefix_caching=PrefixCaching.OFF, **OPTIONS)
    expected = [hf_greedy(hf, p, 8)[0] for p in (first, second)]
    assert [a.token_ids, b.token_ids] == [c.token_ids, d.token_ids] == expected
    assert [o.token_ids for o in cold.generate([first, second], GREEDY)] == expected
    # a batch decoding together (several slots per step) gives the same tokens
    together = LLM(str(path), state_layout=StateLayout.MULTI_PAGE, **OPTIONS).generate([first, second], GREEDY)
    assert [o.token_ids for o in together] == expected


@pytest.mark.slow
def test_gated_deltanet_outputs_are_equal_across_layouts(model_dir: Callable[[str], Path],
                                                          hf_model: Callable[[Path], Any]) -> None:
    path = model_dir("qwen3_5")
    _check(path, hf_model(path))


@pytest.mark.slow
def test_mamba2_outputs_are_equal_across_layouts(mamba_dir: Callable[[str], Path],  # noqa: F811
                                                 mamba_hf: Callable[[str], Any]) -> None:  # noqa: F811
    _check(mamba_dir("bamba"), mamba_hf("bamba"))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "running"), [("qwen3_5", "moving"), ("bamba", "moving"), ("qwen3_5", "fixed")])
def test_kv_server_restores_multi_page_states(kind: str, running: str, model_dir: Callable[[str], Path],
                                              mamba_dir: Callable[[str], Path]) -> None:  # noqa: F811
    """The KV server procedure: run, clear the local prefix cache, run again. Each state's k pages are one
    object group ("state:g<first page group>"), retrieved as one object per chunk; outputs equal the
    one-page layout's (itself equal to transformers, `test_kv_connector.py`); with one running state per
    request too (a loaded state's k pages land in the running state's)."""
    path = model_dir(kind) if kind == "qwen3_5" else mamba_dir(kind)
    batch = prompts([41, 58, 35], seed=4)
    one = LLM(str(path), max_model_len=128, block_size=4).generate(batch, GREEDY)
    with running_server(StoreConfig(chunk_tokens=16, l1_bytes=1 << 26)) as server, \
            LLM(str(path), kv_server=server.endpoint, max_model_len=128, block_size=4,
                state_layout=StateLayout.MULTI_PAGE, running_state=running) as llm:
        first = llm.generate(batch, GREEDY)
        assert llm.reset_prefix_cache()
        second = llm.generate(batch, GREEDY)
        assert llm.transfer is not None
        names = llm.transfer.connector.object_groups
        k = llm.plan.config.pages_per_state
        leads = [g.group_id for g in llm.plan.config.groups if g.state_pages > 1 and g.state_lead]
        got = retrieved(server)
    assert k > 1 and sorted(n for n in names if n.startswith("state:")) == sorted(f"state:g{g}" for g in leads)
    assert sorted(got) == sorted(names) and all(v > 0 for v in got.values()), got
    assert all(o.metrics.external_hit_tokens > 0 and o.metrics.prefix_hit_tokens == 0 for o in second)
    assert [o.token_ids for o in second] == [o.token_ids for o in first] == [o.token_ids for o in one]


@pytest.mark.slow
def test_a_state_over_32_pages_doubles_the_block(tmp_path: Path, hf_model: Callable[[Path], Any]) -> None:
    """Gated DeltaNet heads big enough that a state spans more than `MAX_STATE_PAGES` = 32 pages of 4 tokens.
    By hand (float32): conv 3 x (2 x 2 x 32 + 8 x 32) x 4 = 4,608 B, recurrent 8 x 32 x 32 x 4 = 32,768 B;
    attention 2 x 2 x 16 x 4 = 256 B a token: 4-token pages make 37 pages, 8-token pages 19. The engine
    gathers the 19 pages and gives transformers' tokens; the shared prefix hits at 40 (a chunk end, 8 | 40)."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(**{**COMMON, **GATED_DELTANET, "linear_num_value_heads": 8,
                                               "linear_key_head_dim": 32, "linear_value_head_dim": 32},
                                            architectures=["Qwen3_5ForCausalLM"])
    transformers.Qwen3_5ForCausalLM(config).float().eval().save_pretrained(tmp_path)
    first, tail = prompts([70, 13], seed=7)
    second = first[:44] + tail
    llm, (a, b) = _run(tmp_path, StateLayout.MULTI_PAGE, [first, second], kv_cache_memory_gib=0.05)
    assert (llm.plan.config.attention_block_size, llm.plan.config.pages_per_state) == (8, 19)
    assert b.metrics.prefix_hit_tokens == 40
    hf = hf_model(tmp_path)
    assert [a.token_ids, b.token_ids] == [hf_greedy(hf, p, 8)[0] for p in (first, second)]
