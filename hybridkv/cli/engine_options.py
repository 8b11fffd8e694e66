"""The engine options `hybridkv run` and `hybridkv serve` share: one declaration each (flag, help,
EngineConfig's default), and the keyword dict both pass to `LLM`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hybridkv.engine.config import DEFAULT_MODEL_NAME, EngineConfig
from hybridkv.engine.queue_order import QueueOrder
from hybridkv.kvcache.manager import (
    AdmissionHeadroom,
    CheckpointPlacement,
    DecodeCheckpoints,
    EvictionPolicyName,
    MambaCacheMode,
    PrefixCaching,
)
from hybridkv.plan.kv_cache_config import RunningState, StateLayout

DEFAULTS = EngineConfig.defaults()

Model = Annotated[str, typer.Option("--model", "-m", help="HF-format model directory, or the embedded default")]
KVCacheMemoryGiB = Annotated[float, typer.Option(help="KV cache budget in GiB")]
MaxNumBatchedTokens = Annotated[int, typer.Option(help="token budget per step")]
MaxNumSeqs = Annotated[int, typer.Option(help="most requests running at once")]
MaxModelLen = Annotated[int | None, typer.Option(
    help="longest prompt + output (default: the model's limit, at most 4096)")]
BlockSize = Annotated[int, typer.Option(help="attention block size in tokens")]
PrefixCachingOption = Annotated[PrefixCaching, typer.Option(help="prefix caching")]
MambaCacheModeOption = Annotated[MambaCacheMode, typer.Option(
    help="state checkpoints (Mamba / Gated DeltaNet): align = where a step ends on a block boundary, "
         "all = at every block boundary")]
StateLayoutOption = Annotated[StateLayout, typer.Option(
    "--state-layout", help="Mamba hybrids: one_page (a state in one page, attention blocks of hundreds of tokens, "
                           "as vLLM) or multi_page (a state over several --block-size pages: short prefixes hit)")]
Seed = Annotated[int, typer.Option(help="sampling seed of requests that set none")]
RetentionInterval = Annotated[int | None, typer.Option(
    "--prefix-cache-retention-interval", help="vLLM's option: sliding-window tails and state checkpoints kept "
    "only at each prompt's replay boundary (0), or once per N tokens too (default: at every aligned boundary)")]
MatchUnitOption = Annotated[int | None, typer.Option(
    "--prefix-match-unit", "--hash-block-size", help="vLLM's option: tokens per prefix-cache key (default: the block "
    "size; finer units make hits land inside a block only with a state group in align mode)")]
Eviction = Annotated[EvictionPolicyName, typer.Option(
    "--eviction", help="which cached block is reused first: lru (vLLM's) or value (recency plus compute saved per "
    "byte; window tails and checkpoints at hit points kept, waiting requests' hits protected)")]
Placement = Annotated[CheckpointPlacement, typer.Option(
    "--checkpoint-placement", help="where state checkpoints are written: junction (vLLM's) or placed (also at "
    "popular branch depths)")]
DecodeCheckpointsOption = Annotated[DecodeCheckpoints, typer.Option(
    "--decode-checkpoints", help="state checkpoints decode leaves cached: every (vLLM's: one per block boundary "
    "crossed) or last (a request's newest replaces its previous one)")]
Headroom = Annotated[AdmissionHeadroom, typer.Option(
    "--admission-headroom", help="what a new request leaves free: none (vLLM's), next_block (one block per "
    "group for each running request: no admit-then-preempt churn) or waiting_hits (next_block, and the "
    "cached prefixes waiting requests will hit)")]
RunningStateOption = Annotated[RunningState, typer.Option(
    "--running-state", help="state groups in align mode: moving (vLLM's: a request holds the state it reads and "
    "the one it writes), fixed (one running state per request; hits and checkpoints copied) or adopt (fixed; "
    "a hit on a finished request's end becomes the running state, moved instead of copied)")]
QueueOrderOption = Annotated[QueueOrder, typer.Option(
    "--queue-order", help="which waiting request is admitted next: fcfs (vLLM's) or cache_aware (the longest cached "
    "prefix first, each request passed over at most 32 times)")]
Threads = Annotated[int, typer.Option("--threads", help="torch threads (0: torch default)")]
KVServer = Annotated[str | None, typer.Option(
    "--kv-server", help="KV cache server: tcp://host:port of a running `hybridkv server`, or auto to start one "
                        "(stopped with this command)")]
KVServerTimeout = Annotated[float, typer.Option("--kv-server-timeout-s", help="bound on each call to the KV cache "
                                                                               "server")]

__all__ = [
    "DEFAULTS",
    "DEFAULT_MODEL_NAME",
    "BlockSize",
    "DecodeCheckpointsOption",
    "Eviction",
    "Headroom",
    "KVCacheMemoryGiB",
    "KVServer",
    "KVServerTimeout",
    "MambaCacheModeOption",
    "MatchUnitOption",
    "MaxModelLen",
    "MaxNumBatchedTokens",
    "MaxNumSeqs",
    "Model",
    "Placement",
    "PrefixCachingOption",
    "QueueOrderOption",
    "RetentionInterval",
    "RunningStateOption",
    "Seed",
    "StateLayoutOption",
    "Threads",
    "engine_options",
]


def engine_options(*, kv_cache_memory_gib: float, max_num_batched_tokens: int, max_num_seqs: int,
                   max_model_len: int | None, block_size: int, prefix_caching: PrefixCaching,
                   mamba_cache_mode: MambaCacheMode, seed: int, num_threads: int, kv_server: str | None,
                   kv_server_timeout_s: float, prefix_cache_retention_interval: int | None = None,
                   prefix_match_unit: int | None = None,
                   state_layout: StateLayout = StateLayout.ONE_PAGE,
                   eviction: EvictionPolicyName = EvictionPolicyName.LRU,
                   checkpoint_placement: CheckpointPlacement = CheckpointPlacement.JUNCTION,
                   decode_checkpoints: DecodeCheckpoints = DecodeCheckpoints.EVERY,
                   admission_headroom: AdmissionHeadroom = AdmissionHeadroom.NONE,
                   running_state: RunningState = RunningState.MOVING,
                   queue_order: QueueOrder = QueueOrder.FCFS) -> dict[str, Any]:
    """The `LLM` keywords of the shared options, checked by EngineConfig (ConfigError names a bad one)
    before any model loads; `--kv-server` must be auto or a tcp://host:port (ipc://path) URL."""
    options: dict[str, Any] = dict(
        kv_cache_memory_gib=kv_cache_memory_gib, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size, prefix_caching=prefix_caching,
        mamba_cache_mode=mamba_cache_mode, seed=seed, num_threads=num_threads, kv_server=kv_server,
        kv_server_timeout_s=kv_server_timeout_s, prefix_cache_retention_interval=prefix_cache_retention_interval,
        prefix_match_unit=prefix_match_unit, state_layout=state_layout, eviction=eviction,
        checkpoint_placement=checkpoint_placement, decode_checkpoints=decode_checkpoints,
        admission_headroom=admission_headroom, running_state=running_state, queue_order=queue_order)
    EngineConfig.from_options(options)
    return options
