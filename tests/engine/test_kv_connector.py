"""The engine + KV cache server, verified as the reference verifies its connector: run a
workload, clear only the engine's local prefix cache, run it again; outputs equal to the first
run and to transformers, the server's retrieve counters rose for every object group, and the
engine computed fewer prefill tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cache_server.store import StoreConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.outputs import RequestOutput
from hybridkv.engine.sampler import EosMode, SamplingParams
from tests.cache_server.helpers import RunningServer, running_server
from tests.engine.conftest import hf_greedy, prompts
from tests.engine.mamba_fixtures import mamba_dir, mamba_hf  # noqa: F401  (fixtures)
from tests.engine.test_gemma3n import gemma3n_dir  # noqa: F401  (fixture)

CHUNK = 16
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, eos=EosMode.IGNORE)


@pytest.fixture
def server() -> Iterator[RunningServer]:
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 26)) as s:
        yield s


@pytest.fixture
def server8() -> Iterator[RunningServer]:
    """Chunks of 8 tokens: half of Llama 4's attention chunk, so hits end inside one."""
    with running_server(StoreConfig(chunk_tokens=8, l1_bytes=1 << 26)) as s:
        yield s


def retrieved(server: RunningServer) -> dict[str, float]:
    """Chunks retrieved so far, per object group (from the server's own registry)."""
    out = {}
    for metric in server.store.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "hybridkv_server_retrieved_chunks_total":
                out[sample.labels["object_group"]] = sample.value
    return out


def procedure(llm: LLM, server: RunningServer, batch: list[list[int]]) -> tuple[list[RequestOutput],
                                                                                   list[RequestOutput]]:
    first = llm.generate(batch, GREEDY)
    assert llm.reset_prefix_cache()
    second = llm.generate(batch, GREEDY)
    return first, second


def check(first: list[RequestOutput], second: list[RequestOutput], server: RunningServer,
          object_groups: list[str]) -> None:
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert all(o.metrics.external_hit_tokens > 0 for o in second)
    assert all(o.metrics.prefix_hit_tokens == 0 for o in second)  # the local cache was cleared
    assert sum(o.metrics.computed_prefill_tokens for o in second) < sum(
        o.metrics.computed_prefill_tokens for o in first)
    got = retrieved(server)
    assert sorted(got) == sorted(object_groups) and all(v > 0 for v in got.values()), got


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss", "llama4"])
def test_procedure_attention_models(kind: str, model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any],
                                    request: pytest.FixtureRequest) -> None:
    path = model_dir(kind)
    server: RunningServer = request.getfixturevalue("server8" if kind == "llama4" else "server")
    block = 8 if kind == "llama4" else 16
    batch = prompts([41, 58, 35], seed=3)
    with LLM(str(path), kv_server=server.endpoint, max_model_len=128, block_size=block) as llm:
        first, second = procedure(llm, server, batch)
        names = llm.transfer.connector.object_groups if llm.transfer else []
    check(first, second, server, names)
    for prompt, out in zip(batch, second, strict=True):
        assert out.token_ids == hf_greedy(hf_model(path), prompt, NEW)[0]


@pytest.mark.parametrize(("kind", "mode", "running"), [
    ("qwen3_5", "align", "moving"), ("qwen3_5", "all", "moving"), ("bamba", "align", "moving"),
    ("bamba", "all", "moving"), ("qwen3_5", "align", "fixed"), ("bamba", "align", "fixed")])
def test_procedure_state_models(kind: str, mode: str, running: str, model_dir: Callable[[str], Path],
                                mamba_dir: Callable[[str], Path], hf_model: Callable[[Path], Any],  # noqa: F811
                                server: RunningServer) -> None:
    # (fixed: one running state per request; a loaded state lands in the running block)
    path = model_dir(kind) if kind == "qwen3_5" else mamba_dir(kind)
    batch = prompts([41, 58, 35], seed=4)
    with LLM(str(path), kv_server=server.endpoint, max_model_len=128, mamba_cache_mode=mode,
             running_state=running) as llm:
        first, second = procedure(llm, server, batch)
        names = llm.transfer.connector.object_groups if llm.transfer else []
    check(first, second, server, names)
    assert any(name.startswith("state:") for name in names)
    if kind == "qwen3_5":  # the Mamba2 reference needs its dt clamp removed: compared in test_mamba_models
        for prompt, out in zip(batch, second, strict=True):
            assert out.token_ids == hf_greedy(hf_model(path), prompt, NEW)[0]


def test_procedure_gemma3n_kv_sharing(gemma3n_dir: Path, hf_model: Callable[[Path], Any],  # noqa: F811
                                      server: RunningServer) -> None:
    batch = prompts([41, 35], seed=5)
    with LLM(str(gemma3n_dir), kv_server=server.endpoint, max_model_len=128) as llm:
        first, second = procedure(llm, server, batch)
        names = llm.transfer.connector.object_groups if llm.transfer else []
    check(first, second, server, names)
    for prompt, out in zip(batch, second, strict=True):
        assert out.token_ids == hf_greedy(hf_model(gemma3n_dir), prompt, NEW)[0]


@pytest.mark.parametrize(("kind", "expected"), [
    ("gemma3", {"full": 2, "window:1": 1}),  # window 8 < chunk 16: only the chunk holding tokens [25, 32)
    ("qwen3_5", {"full": 2, "state:g0": 1, "state:g1": 1, "state:g2": 1}),  # each state group: the last chunk
])
def test_object_groups_retrieve_only_what_their_rule_needs(kind: str, expected: dict[str, int],
                                                           model_dir: Callable[[str], Path],
                                                           server: RunningServer) -> None:
    """A 41-token prompt: the server hit is 32 tokens (2 chunks; the last token is computed)."""
    [prompt] = prompts([41], seed=6)
    with LLM(str(model_dir(kind)), kv_server=server.endpoint, max_model_len=128) as llm:
        llm.generate([prompt], GREEDY)
        llm.reset_prefix_cache()
        [out] = llm.generate([prompt], GREEDY)
        assert llm.transfer is not None
        stats = llm.transfer.connector.stats
        groups = llm.plan.config.groups
    assert out.metrics.external_hit_tokens == 32
    got = retrieved(server)
    assert {k: int(v) for k, v in got.items()} == expected
    # Bytes, by hand: per engine group, the blocks its rule needs x its layers x its page bytes.
    needed_blocks = {"full": 2, "sliding_window": 1, "mamba": 1}
    want = sum(needed_blocks[g.kind.value] * len(g.layer_indices) * g.spec.page_size_bytes(g.block_size)
               for g in groups)
    assert stats.loaded_bytes == want



def test_cache_aware_queue_order_with_the_kv_server(model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any],
                                                    server: RunningServer) -> None:
    # One request runs at a time, so the queue order decides; the KV server's hits still load and the
    # tokens are transformers' greedy ones.
    path = model_dir("qwen3_5")
    batch = prompts([41, 58, 35], seed=5)
    with LLM(str(path), kv_server=server.endpoint, max_model_len=128, max_num_seqs=1,
             queue_order="cache_aware") as llm:
        first, second = procedure(llm, server, batch)
        names = llm.transfer.connector.object_groups if llm.transfer else []
    check(first, second, server, names)
    for prompt, out in zip(batch, second, strict=True):
        assert out.token_ids == hf_greedy(hf_model(path), prompt, NEW)[0]
