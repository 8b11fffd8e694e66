"""`LLM`: the engine's public entry point, and `EngineConfig`, its options.

    llm = LLM("path/to/hf_model_dir", max_num_batched_tokens=256)     # or LLM() for the default
    outputs = llm.generate(["Hello", [2, 104, 105]], SamplingParams(max_tokens=16))

Beneath `generate`, the incremental API (continuous batching; outputs.py): `add_request`
queues a request, `step` runs one step and returns each request's new tokens (and its output when
it finishes), `abort` frees a request's blocks, `has_unfinished` says whether a step has work.

Construction: config.json -> model (models/) + ModelSpec (core.model_specs) -> plan (core.planner)
-> KVCacheManager (core) and ModelRunner (same KVCacheConfig) -> Scheduler.

With `kv_server=URL | "auto"` the KV cache tensors live in shared memory registered with a KV
cache server (engine/kv_offload.py); each step then loads the external hits the scheduler
allocated before the forward pass and stores the chunks the step completed after it.
`reset_prefix_cache()` clears only the local prefix cache (`external=True` also the server's).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import reprlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridkv.catalog import find as find_catalog_entry
from hybridkv.connector.base import ConnectorMeta, StepWork
from hybridkv.connector.transfer import StateSaves
from hybridkv.engine.config import DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL_NAME, EngineConfig
from hybridkv.engine.default_model import ensure_default_model
from hybridkv.engine.kv_events import KVEventStream
from hybridkv.engine.kv_offload import KVTransfer, model_identity
from hybridkv.engine.loader import load_model, safetensors_files, torch_dtype
from hybridkv.engine.outputs import LiveRequests, RequestMetrics, RequestOutput, StepOutput
from hybridkv.engine.request import Request
from hybridkv.engine.runner import ModelRunner, StepItem
from hybridkv.engine.sampler import SamplingParams, TokenHistory, sample, top_logprobs
from hybridkv.engine.state_layers import StateIO
from hybridkv.engine.tokenizer import Tokenizer, load_tokenizer
from hybridkv.errors import ConfigError
from hybridkv.host_memory import check_fits
from hybridkv.kv_events.wire import KVEventsConfig
from hybridkv.kvcache.events import KVEvents
from hybridkv.kvcache.ids import NULL_BLOCK_ID, BlockId, RequestId
from hybridkv.kvcache.manager import KVCacheManager, MambaCacheMode, ManagerStats, PrefixCaching
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.model_specs import IndexerFormat, SpecOptions, load_config, model_spec_from_config
from hybridkv.plan.planner import Plan, PlannerOptions, memory_gib_to_bytes, plan, resolve_max_model_len
from hybridkv.plan.specs import ModelSpec, SpecKind
from hybridkv.scheduling.queue_order import WindowedAdmission
from hybridkv.scheduling.scheduler import ScheduledWork, Scheduler, SchedulerOutput

Prompt = str | Sequence[int]


@dataclass(slots=True)
class EngineStats:
    """Counters over the engine's life; `peak_*_bytes` compare hybrid use with the uniform layout."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    peak_kv_bytes: int = 0
    peak_uniform_kv_bytes: int = 0
    peak_unshared_kv_bytes: int = 0  # hybrid layout, each request's blocks counted as if not shared
    peak_group_blocks: list[int] = field(default_factory=list)


def resolve_model_dir(model: str) -> Path:
    """An HF-format directory for `model`: the default model's name, or a directory path."""
    if model in (DEFAULT_MODEL_NAME, "default"):
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if find_catalog_entry(model) is not None:
        raise ConfigError(
            f"{model!r} is a catalog entry: the catalog ships configs without weights, so it can be planned "
            f"(`hybridkv plan {model}`) but not run; give an HF-format directory (config.json + *.safetensors) "
            f"or {DEFAULT_MODEL_NAME!r}"
        )
    raise ConfigError(f"model {model!r} is neither {DEFAULT_MODEL_NAME!r} nor a directory with config.json")


class LLM:
    """Offline generation over the hybrid KV cache (one process, CPU)."""

    def __init__(self, model: str = DEFAULT_MODEL_NAME, **options: Any) -> None:
        self.config = EngineConfig.from_options(options)
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model_dir = resolve_model_dir(model)
        # Everything config.json and the options decide is checked before the weights load.
        self.model_spec: ModelSpec = model_spec_from_config(load_config(self.model_dir), name=model,
                                                            options=SpecOptions(
                                                                dtype=cfg.dtype, indexer=IndexerFormat.UNQUANTIZED))
        self.max_model_len = resolve_max_model_len(
            cfg.max_model_len, model=model, model_limit=self.model_spec.max_position_embeddings,
            default_cap=DEFAULT_MAX_MODEL_LEN)
        self.plan: Plan = plan(self.model_spec, PlannerOptions(
            memory_bytes=memory_gib_to_bytes(cfg.kv_cache_memory_gib, option="kv_cache_memory_gib"),
            max_model_len=self.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size,
            mamba_cache_mode=cfg.cache.mamba_cache_mode, state_layout=cfg.cache.state_layout,
            running_state=cfg.cache.running_state))
        check_fits(kv_cache_gib=cfg.kv_cache_memory_gib,
                   weights_bytes=sum(f.stat().st_size for f in safetensors_files(self.model_dir)))
        self.model, _ = load_model(self.model_dir, dtype=torch_dtype(cfg.dtype))
        kv_events = KVEventsConfig.from_json(cfg.kv_events_config or "{}")
        cache = dataclasses.replace(cfg.cache, events=KVEvents.ON) if kv_events.enabled else cfg.cache
        self.manager = KVCacheManager(self.plan.config, max_model_len=self.max_model_len, options=cache)
        self.kv_events = KVEventStream(kv_events, self.manager) if kv_events.enabled else None
        self.transfer: KVTransfer | None = self._attach_kv_server(model) if cfg.kv_server else None
        self.runner = ModelRunner(self.model, self.plan.config,
                                  buffers=self.transfer.tensors if self.transfer else None)
        align = self._align_tokens()
        unit = self.manager.match_unit
        self.scheduler: Scheduler[Request] = Scheduler(self.manager, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_num_seqs=cfg.max_num_seqs, align_tokens=align,
                                   connector=self.transfer.connector if self.transfer else None,
                                   partial_unit_tokens=unit.hash_unit_tokens if align and unit.partial_hits else 0,
                                   queue_order=cfg.cache.queue_order, window=WindowedAdmission.of(cfg.cache))
        self.tokenizer: Tokenizer = load_tokenizer(self.model_dir)
        self.stats = EngineStats(peak_group_blocks=[0] * len(self.plan.config.groups))
        self._uniform_bytes_per_token = sum(s.page_size_bytes(1) for _, s in self.model_spec.owned_layers())
        self._next_id = 0
        self._live = LiveRequests()

    def _attach_kv_server(self, name: str) -> KVTransfer:
        cfg = self.config
        assert cfg.kv_server is not None
        has_state = any(g.kind is SpecKind.MAMBA for g in self.plan.config.groups)
        unit = self.manager.match_unit
        if unit.partial_hits:
            raise ConfigError(f"kv_server with prefix_match_unit={unit.hash_unit_tokens} (hits inside the "
                              f"{unit.scheduler_block_tokens}-token blocks, copied on write) is not supported yet; "
                              f"expected a unit of at least {unit.scheduler_block_tokens} tokens (or None), "
                              "or no kv_server")
        if has_state and cfg.cache.prefix_caching is PrefixCaching.OFF:
            raise ConfigError("kv_server with a state model (Mamba / Gated DeltaNet) needs prefix_caching on: "
                              "without it a state group keeps one running state, no checkpoint to store")
        all_boundaries = cfg.cache.mamba_cache_mode is MambaCacheMode.ALL
        saves = StateSaves.EVERY_BOUNDARY if all_boundaries else StateSaves.AT_STEP_END
        return KVTransfer.attach(cfg.kv_server, config=self.plan.config, state_saves=saves,
                                 model_id=model_identity(name, self.model_dir, cfg.dtype),
                                 timeout_s=cfg.kv_server_timeout_s)

    def close(self) -> None:
        """Detach from the KV cache server (and stop the one started for "auto"), stop publishing KV
        events; idempotent."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.transfer is not None:
            self.scheduler.connector = None  # the engine goes on with its local cache only
            self.transfer.close()
            self.transfer = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def reset_prefix_cache(self, *, external: bool = False) -> bool:
        """Forget the local prefix cache (False, nothing done, while requests hold blocks); with
        `external`, also clear the KV cache server (every engine's objects there)."""
        if not self.manager.reset_prefix_cache():
            return False
        if self.kv_events is not None:
            self.kv_events.publish()
        if external and self.transfer is not None:
            self.transfer.connector.clear()
        return True

    def _align_tokens(self) -> int:
        """Block size prefill chunks end on: the state groups' in align mode with prefix caching, else 0
        (ALL mode checkpoints every boundary a step crosses, so chunks need no cut)."""
        state_blocks = {g.block_size for g in self.plan.config.groups if g.kind is SpecKind.MAMBA}
        cfg = self.config
        if (not state_blocks or cfg.cache.prefix_caching is PrefixCaching.OFF
                or cfg.cache.mamba_cache_mode in (MambaCacheMode.ALL, MambaCacheMode.NONE)):
            return 0
        block = max(state_blocks)
        if self.plan.config.pages_per_state > 1 and self.transfer is not None:
            # multi-page states have small blocks: cut on the server's chunks too, so a prompt's last
            # checkpoint lands where the server stores a chunk (docs/state_layout.md)
            return math.lcm(block, self.transfer.connector.chunk_tokens or block)
        return block

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache tensors the runner allocated (== the plan's `total_bytes`)."""
        return self.runner.kv_cache_bytes

    def manager_stats(self) -> ManagerStats:
        return self.manager.stats()

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_finish: Callable[[RequestOutput], None] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        cache_checkpoints: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        `cache_salt` (one for all, or one per prompt): requests with different salts never share
        a cached block, locally or through the KV cache server (tenant isolation).
        `cache_checkpoints` (one sequence of token positions per prompt): where later requests are
        expected to resume (e.g. the ends of a chat's turns); state checkpoints are written there and
        a value-aware eviction keeps them (docs/prefix_caching.md).

        Raises ConfigError (naming the prompt's index) for a bare str instead of a list, an empty
        prompt, a non-integer or out-of-vocabulary token id, a prompt longer than `max_model_len`
        or more logprobs than the vocabulary; CapacityError if a request can never get KV cache
        blocks. On any error the call's requests are dropped, so the engine stays usable.
        """
        if isinstance(prompts, str):
            raise ConfigError(f"prompts must be a list of prompts, got a single str {reprlib.repr(prompts)}; "
                              "expected e.g. [prompt]")
        if self._live:
            raise ConfigError(f"generate() called while {len(self._live)} request(s) from add_request() are "
                              "unfinished; step() them to the end or abort() them first")
        params = [sampling or SamplingParams()] * len(prompts) if not isinstance(sampling, Sequence) else sampling
        if len(params) != len(prompts):
            raise ConfigError(f"got {len(params)} sampling params for {len(prompts)} prompts; expected one or one each")
        salts = [cache_salt] * len(prompts) if cache_salt is None or isinstance(cache_salt, str) else list(cache_salt)
        if len(salts) != len(prompts) or any(x is not None and not isinstance(x, str) for x in salts):
            raise ConfigError(f"cache_salt must be a str, None, or one str/None per prompt ({len(prompts)}); got "
                              f"{reprlib.repr(cache_salt)}")
        checkpoints = list(cache_checkpoints) if cache_checkpoints is not None else [()] * len(prompts)
        if len(checkpoints) != len(prompts):
            raise ConfigError(f"cache_checkpoints must hold one sequence of positions per prompt ({len(prompts)}); "
                              f"got {len(checkpoints)}")
        requests = [self._make_request(p, s, index=i, cache_salt=salt, cache_checkpoints=points)
                    for i, (p, s, salt, points) in enumerate(zip(prompts, params, salts, checkpoints, strict=True))]
        ids = [self._enqueue(request) for request in requests]
        outputs: dict[str, RequestOutput] = {}
        try:
            while self.has_unfinished:
                for step in self.step():
                    if step.finished is not None:
                        outputs[step.request_id] = step.finished
                        if on_finish is not None:
                            on_finish(step.finished)
        except BaseException:  # CapacityError, Ctrl-C: drop this call's requests so the next call starts clean
            for request_id in ids:
                self.abort(request_id)
            raise
        return [outputs[request_id] for request_id in ids]

    def add_request(self, prompt: Prompt, sampling: SamplingParams | None = None, *,
                    cache_salt: str | None = None, cache_checkpoints: Sequence[int] = ()) -> str:
        """Queue one request (text or token ids) for the next `step`; returns its id.

        Validated as `generate` validates a prompt (ConfigError, naming it "prompt"), so nothing is
        queued for a bad one. The request joins the batch of whatever else is running.
        """
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ConfigError(f"cache_salt must be a str or None, got {reprlib.repr(cache_salt)}")
        return self._enqueue(self._make_request(prompt, sampling or SamplingParams(), index=None,
                                                cache_salt=cache_salt, cache_checkpoints=cache_checkpoints))

    def step(self) -> list[StepOutput]:
        """Run one engine step; per request that got tokens in it (or finished), a StepOutput.

        A finished request's StepOutput carries its RequestOutput, and its blocks are already
        freed. Raises CapacityError if the request at the head of the queue can never get blocks
        (the engine stays usable once that request is aborted).
        """
        finished = self._step()
        if self.kv_events is not None:
            self.kv_events.publish([r.kv for r in (*self.scheduler.running, *finished)])
        return self._live.step_outputs(finished, self._output)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (cached ones stay in the prefix cache); False if unknown or done."""
        request = self._live.pop(request_id)
        if request is None:
            return False
        self.scheduler.abort([request])
        return True

    @property
    def has_unfinished(self) -> bool:
        """Whether some added request is still waiting or running (so `step` has work)."""
        return self.scheduler.has_unfinished

    def _enqueue(self, request: Request) -> str:
        self.scheduler.add(request)
        self._live.add(request)
        return request.request_id

    def _prompt_ids(self, prompt: Prompt, index: int | None) -> list[int]:
        """The validated token ids of one prompt (ConfigError naming the prompt otherwise)."""
        label = "prompt" if index is None else f"prompt {index}"
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ConfigError(f"{label} must be a str or a sequence of int token ids, "
                                  f"got {reprlib.repr(prompt)}") from None
        return self.check_prompt(ids, label=label)

    def check_prompt(self, ids: list[int], *, label: str, length_option: str = "max_model_len") -> list[int]:
        """`ids` when they are a valid prompt; else ConfigError starting with `label`.

        Valid: at least one token, every id in the vocabulary, at most `max_model_len` tokens
        (`length_option` is how the message names that limit, e.g. `--max-model-len`).
        """
        vocab = int(self.model.hf_config["vocab_size"])
        if not ids:
            raise ConfigError(f"{label} is empty; expected at least one token")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ConfigError(f"{label}: token ids must lie in [0, {vocab}), got min {min(ids)} and max {max(ids)}")
        if len(ids) > self.max_model_len:
            raise ConfigError(f"{label} has {len(ids)} tokens; expected at most {length_option} {self.max_model_len} "
                              f"(the model allows up to {self.model_spec.max_position_embeddings})")
        return ids

    def _make_request(self, prompt: Prompt, sampling: SamplingParams, *, index: int | None,
                      cache_salt: str | None = None, cache_checkpoints: Sequence[int] = ()) -> Request:
        ids = self._prompt_ids(prompt, index)
        points = tuple(cache_checkpoints)
        if any(isinstance(c, bool) or not isinstance(c, int) or c <= 0 for c in points):
            where = "" if index is None else f" of prompt {index}"
            raise ConfigError(f"cache_checkpoints{where} must be positive token positions, got {reprlib.repr(points)}")
        vocab = int(self.model.hf_config["vocab_size"])
        label = "" if index is None else f" {index}"
        if not isinstance(sampling, SamplingParams):
            raise ConfigError(f"sampling params{label} must be a SamplingParams, got {type(sampling).__name__}")
        if sampling.logprobs > vocab:
            raise ConfigError(f"prompt{label} asks for {sampling.logprobs} logprobs; expected at most the "
                              f"vocabulary size {vocab}")
        seq = self._next_id
        self._next_id += 1
        seed = sampling.seed if sampling.seed is not None else self.config.seed + seq
        return Request(
            kv=KVRequest(request_id=RequestId(f"req-{seq}"), token_ids=list(ids), cache_salt=cache_salt,
                         cache_checkpoints=points),
            arrival_seq=seq,
            prompt_len=len(ids), sampling=sampling, generator=torch.Generator().manual_seed(seed),
            arrival_s=time.perf_counter(), eos_token_ids=self.model.eos_token_ids,
        )

    def _step(self) -> list[Request]:
        out = self.scheduler.schedule()
        if self.kv_events is not None:  # (the cache as the next step's admissions will find it: see kv_events.py)
            self.kv_events.publish([r.kv for r in self.scheduler.running])
        self._track_memory(out)
        if out.copies:  # partial hits' copy on write: before anything reads or writes those blocks
            self.runner.copy_blocks([(int(c.src_block_id), int(c.dst_block_id)) for c in out.copies])
        work = list(out.work)
        tables = {w.request.request_id: self.manager.block_ids(w.request.request_id) for w in work}
        saves = self._load_external(work, tables) if self.transfer is not None else None
        if not work:  # every request of the step failed to load: requeued, recomputed next step
            return []
        items = [StepItem(token_ids=w.request.kv.token_ids[w.start_pos : w.start_pos + w.num_tokens],
                          start_pos=w.start_pos, block_ids=tables[w.request.request_id],
                          sample=w.samples, state_io=self._state_io(w)) for w in work]
        logits = self.runner.execute(items)  # [sampling items, vocab]
        if out.checkpoint_copies:  # RunningState.FIXED: running states out into their checkpoints
            self.runner.copy_blocks([(int(c.src_block_id), int(c.dst_block_id)) for c in out.checkpoint_copies])
        if saves is not None and self.transfer is not None:
            self.transfer.connector.save_kv(saves)  # the chunks this step completed, window blocks still live
            self.transfer.connector.wait_for_save()
        sampled = [w.request for w in work if w.samples]
        histories = [TokenHistory(token_ids=r.kv.token_ids, prompt_len=r.prompt_len, eos_token_ids=r.eos_token_ids)
                     for r in sampled]
        tokens = sample(logits, [r.sampling for r in sampled], [r.generator for r in sampled], histories)
        now = time.perf_counter()
        for row, (request, token) in enumerate(zip(sampled, tokens, strict=True)):
            if request.sampling.logprobs:
                request.logprobs.append(top_logprobs(logits[row], request.sampling.logprobs, token=token))
            request.append_token(token, now_s=now, max_model_len=self.max_model_len)
        self.stats.steps += 1
        self.stats.scheduled_tokens += out.num_tokens
        self.stats.preemptions += len(out.preempted)
        return self.scheduler.finish_step(work)

    def _load_external(self, work: list[ScheduledWork[Request]], tables: dict[RequestId, tuple[list[BlockId], ...]]
                       ) -> ConnectorMeta:
        """Load the step's external hits into their blocks; drop (and requeue) the requests whose
        load failed from `work`; returns the step's connector metadata (its saves) without them."""
        assert self.transfer is not None
        connector = self.transfer.connector
        meta = connector.build_connector_meta([
            StepWork(request=w.request.kv, start=w.start_pos, end=w.start_pos + w.num_tokens,
                     block_tables=tables[w.request.request_id]) for w in work])
        connector.start_load_kv(meta)
        connector.wait_for_load()
        failed = connector.get_failed_loads()
        if failed:
            self.scheduler.load_failed([w.request for w in work if w.request.request_id in failed])
            work[:] = [w for w in work if w.request.request_id not in failed]
            meta = ConnectorMeta(saves=tuple(s for s in meta.saves if s.request_id not in failed))
        for w in work:
            if w.external_tokens:  # loaded: its blocks hold valid KV now, so they may be cached
                self.manager.cache(w.request.kv, min(w.start_pos + w.num_tokens, w.request.num_tokens))
        return meta

    def _state_io(self, work: ScheduledWork[Request]) -> dict[int, StateIO]:
        """Per state group, the blocks the manager says this step restores from and writes to."""
        if not self.runner.states.groups:
            return {}
        steps = self.manager.state_steps(work.request.request_id, start_tokens=work.start_pos,
                                         end_tokens=work.start_pos + work.num_tokens)
        return {int(s.group_id): StateIO(read=None if s.read is None else int(s.read.block_id),
                                         writes=tuple((c.num_tokens, int(c.block_id)) for c in s.writes))
                for s in steps}

    def _track_memory(self, out: SchedulerOutput[Request]) -> None:
        """Peak KV bytes held (hybrid, shared blocks once), the same without sharing, and the uniform layout's."""
        config = self.plan.config
        blocks = self.manager.group_usage()
        stats = self.stats
        stats.peak_group_blocks = [max(a, b) for a, b in zip(stats.peak_group_blocks, blocks, strict=True)]
        stats.peak_kv_bytes = max(stats.peak_kv_bytes, sum(blocks) * config.bytes_per_block)
        block = self.plan.uniform.block_size
        tokens = {r.request_id: r.num_computed_tokens for r in self.scheduler.running}
        tokens.update({w.request.request_id: w.start_pos + w.num_tokens for w in out.work})
        uniform = sum(math.ceil(t / block) * block for t in tokens.values()) * self._uniform_bytes_per_token
        stats.peak_uniform_kv_bytes = max(stats.peak_uniform_kv_bytes, uniform)
        held = sum(len(table) - table.count(NULL_BLOCK_ID) for rid in tokens for table in self.manager.block_ids(rid))
        stats.peak_unshared_kv_bytes = max(stats.peak_unshared_kv_bytes, held * config.bytes_per_block)

    def _output(self, request: Request) -> RequestOutput:
        assert request.finish_reason is not None and request.first_token_s is not None and request.finish_s
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.kv.token_ids[: request.prompt_len],
            token_ids=list(request.output_ids), text=self.tokenizer.decode(list(request.output_ids)),
            finish_reason=request.finish_reason, logprobs=list(request.logprobs),
            metrics=RequestMetrics(ttft_s=request.first_token_s - request.arrival_s,
                                   latency_s=request.finish_s - request.arrival_s,
                                   prefix_hit_tokens=max(request.prefix_hit_tokens, 0),
                                   num_preemptions=request.num_preemptions,
                                   external_hit_tokens=request.external_hit_tokens,
                                   computed_prefill_tokens=request.computed_prefill_tokens),
        )
