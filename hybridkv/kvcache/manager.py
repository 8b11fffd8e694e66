"""The KV cache manager: the facade an engine's scheduler calls.

    KVCacheManager  ->  coordinator (all groups)  ->  one manager per hit rule (its groups) -> block pool

A step of one request, in tokens (`allocate` arguments in brackets):

    | computed | new hits | external hits | new tokens | lookahead |
    0          ^          ^               ^            ^            ^ total slots
               |          hit.num_tokens  |            |            (num_lookahead_tokens)
               request.num_computed_tokens|            end = first_new + num_new_tokens
                                          first_new = computed + hits + num_external_tokens

    blocks are allocated up to `total slots`; full blocks are cached up to
    min(end, request.num_tokens) unless caching is DELAYED (then call `cache` later).

The engine advances `request.num_computed_tokens` itself, after the step, to `end`.
Verbs: begin_step, lookup, peek, allocate, cache, free, block_ids, state_steps, reset_prefix_cache,
usage, group_usage, stats, take_pending_copies, take_events, check_integrity (docs/kv_cache_manager.md);
the cache policies (`policies`, built from `options`) are called at fixed points (policies/__init__.py).

Partial hits (`prefix_match_unit` below a state group's block in align mode): a hit may end inside a
block; the request gets a private copy of it, run before the forward (`take_pending_copies`).

State groups (Mamba, Gated DeltaNet): `mamba_cache_mode=MambaCacheMode.ALIGN | ALL` selects
where checkpoints are kept; `state_steps` tells the runner which block each state is read from
and written to. A checkpoint cached in a step is hit only from the next step on: the scheduler
calls `begin_step()` at the start of every step, and `allocate` refuses (returns None) a hit on
a checkpoint cached since then (`CacheHit.deferred`).
"""

from __future__ import annotations

import functools
import math
from itertools import chain, repeat
from operator import add
from typing import cast

import numpy as np

from hybridkv.errors import AllocationError, ConfigError, IntegrityError, StaleHitError, UnknownRequestError
from hybridkv.kvcache.assembly import make_coordinator, make_type_managers
from hybridkv.kvcache.block_pool import BlockPool, KVEvent
from hybridkv.kvcache.coordinator import GroupBlocks
from hybridkv.kvcache.events import KVEvents
from hybridkv.kvcache.hashing import BlockHasher
from hybridkv.kvcache.hit_checks import check_no_hit_start, resolve_hit, verify_hit
from hybridkv.kvcache.hit_limits import HitLimit, HitLimitCounter
from hybridkv.kvcache.ids import BlockHash, BlockId, RequestId
from hybridkv.kvcache.integrity import check_manager_integrity
from hybridkv.kvcache.options import (
    MECHANISM_DEFAULTS,
    PRESETS,
    AdmissionHeadroom,
    CacheOptions,
    CheckpointPlacement,
    DecodeCheckpoints,
    EvictionPolicyName,
    OnlineChoice,
    PrefixCaching,
    ReleaseOrder,
    SlidingWindowCaching,
    SpecDecode,
)
from hybridkv.kvcache.policies import CachePolicies, build_policies, eviction_factory
from hybridkv.kvcache.probe_memo import WaitingProbes
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.results import (
    BlockCopy,
    CacheHit,
    CacheTiming,
    ManagerStats,
    NewBlocks,
    StateCheckpoint,
    StateStep,
)
from hybridkv.kvcache.retention import Retention
from hybridkv.kvcache.running_state import fixed_state_managers, state_steps
from hybridkv.kvcache.type_managers.base import SingleTypeManager
from hybridkv.plan.match_unit import MatchUnit
from hybridkv.plan.planner import KVCacheConfig, RunningState
from hybridkv.plan.specs import MambaCacheMode

__all__ = ["PRESETS", "AdmissionHeadroom", "AllocationError", "BlockCopy", "CacheHit", "CacheOptions", "CacheTiming",
           "CheckpointPlacement", "DecodeCheckpoints", "EvictionPolicyName", "HitLimit", "IntegrityError",
           "KVCacheManager", "MambaCacheMode", "ManagerStats", "MatchUnit", "NewBlocks", "PrefixCaching",
           "ReleaseOrder", "RunningState", "SlidingWindowCaching", "SpecDecode", "StaleHitError", "StateCheckpoint",
           "StateStep", "UnknownRequestError"]


def shadow_manager(config: KVCacheConfig, max_model_len: int,
                   options: CacheOptions) -> tuple[KVCacheManager, CachePolicies]:
    """A ghost of the online choice (`policies/ghosts.py`) and its policies: a manager with `options` (the
    online choice and events off) whose allocations answer empty entries and whose copies are dropped
    unbuilt (a multi-page checkpoint: one per page group); its blocks change as any manager's."""
    ghost = KVCacheManager(config, max_model_len=max_model_len,
                           options=options.replace(online_choice=OnlineChoice.OFF, events=KVEvents.OFF))
    ghost._answers = ghost._coordinator.reports_entries = False
    return ghost, ghost.policies


class KVCacheManager:
    """Hands out block ids per KV cache group and keeps the prefix cache of all groups."""

    def __init__(self, config: KVCacheConfig, *, max_model_len: int,
                 options: CacheOptions = MECHANISM_DEFAULTS) -> None:
        """A manager for `config`'s groups with the cache knobs of `options` (`kvcache/options.py`).

        Raises:
            ConfigError: `max_model_len` not positive, a config without groups, or options these
                groups cannot take (`CacheOptions.validate`).
        """
        if max_model_len <= 0:
            raise ConfigError(f"max_model_len must be a positive integer, got {max_model_len}")
        if not config.groups:
            raise ConfigError(f"KV cache config of {config.model!r} has no groups")
        for index, group in enumerate(config.groups):
            if group.group_id != index:
                raise ConfigError(f"group at position {index} has group_id {group.group_id}; expected {index}")
        if not isinstance(options, CacheOptions):
            raise ConfigError(f"options must be a CacheOptions, got {type(options).__name__}")
        self.config = config
        self.max_model_len = max_model_len
        self.options = options
        #: where hits land (vLLM's prefix_match_unit resolved for these groups; docs/prefix_caching.md)
        self.match_unit = options.validate(config)
        self.mamba_cache_mode = options.mamba_cache_mode
        self._caching = options.caching
        self._pool = BlockPool(num_blocks=config.num_blocks, groups=config.groups,
                               policy_factory=eviction_factory(options.eviction), events=options.events)
        self._eagle = options.spec_decode is SpecDecode.EAGLE
        retention = Retention(sliding=options.sliding_window_caching,
                              interval_tokens=options.prefix_cache_retention_interval,
                              alignment_tokens=math.lcm(*(g.block_size for g in config.groups)),
                              spec_decode=options.spec_decode, decode_checkpoints=options.decode_checkpoints)
        managers = make_type_managers(config, self._pool, options, retention)
        #: the cache policies `options` asks for (`policies/`); `policies.stats()` is their public view
        self.policies = build_policies(options, self._pool, managers,
                                       alignment_tokens=math.lcm(*(m.block_size for m in managers)))
        self._coordinator = make_coordinator(managers, self._pool, options, self.policies)
        self._fixed = fixed_state_managers(managers)
        self._partial = self.match_unit.partial_hits
        if self._partial:
            self._coordinator.enable_partial_hits(self.match_unit.hash_unit_tokens)
        #: the verbs answer entries and copies (False: a ghost's, `shadow_manager`)
        self._answers = True
        if options.online_choice is OnlineChoice.GHOSTS and self._caching:  # (policies/ghosts.py)
            self.policies.start_ghosts(functools.partial(shadow_manager, config, max_model_len, options))
        self._observer = self.policies.observer
        self._groups = self._coordinator.groups  # per group: (its manager, its row there)
        self._group_block_sizes = [m.block_size for m, _ in self._groups]
        self._hasher = BlockHasher(algo=options.hash_algo, seed=options.hash_seed)
        self._block_sizes = tuple(sorted({*self._coordinator.block_sizes, self._coordinator.hit_step}))
        self._copies = 0
        self._empty_hit = tuple(() for _ in config.groups)
        self._no_new_blocks = NewBlocks(() for _ in config.groups)
        # (the decode path releases position by position: vLLM's group-by-group order takes the general path)
        self._decodes = (self._caching and self._coordinator.decodes
                         and options.release_order is ReleaseOrder.INTERLEAVED and not self._partial)
        self._probes = WaitingProbes(self._coordinator, self.policies, self._hashes, self._pool.pmaps)
        self._lookups = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._group_hit_tokens = [0] * len(config.groups)
        self._limits = HitLimitCounter(self._coordinator.managers, [m for m, _ in self._groups],
                                       self._coordinator.lcm_block_size)

    # -- step / lookup --------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new scheduling step starts: state checkpoints cached before now become hittable.

        Call it once per step, before the step's first `lookup` / `allocate` (vLLM's
        `new_step_starts`). Without it, hits on checkpoints cached since the last call wait.
        """
        self._coordinator.new_step()
        self.policies.new_step()
        self._probes.new_step()

    def lookup(self, request: KVRequest) -> CacheHit:
        """The longest prefix every group can serve, at most `num_tokens - 1` tokens (the last
        token is always computed, for its logits). Counts toward `stats()`.

        Args:
            request: a new or preempted request (its `block_hashes` are extended as needed).

        Returns:
            The hit: its length in tokens and its block ids per group; pass it to `allocate`
            unchanged (`num_tokens == 0`: no hit; `deferred`: retry in the next step).
        """
        total = request.num_tokens
        self._lookups += 1
        self._query_tokens += total
        max_length = min(total - 1, self.max_model_len)
        request.shared_prefix_boundary = 0
        if request.num_prompt_tokens is None:
            request.num_prompt_tokens = total
        coordinator = self._coordinator
        if not self._caching or max_length < coordinator.hit_step:
            if self._caching and max_length > 0:
                self._limits.count({}, 0, max_length, deferred=False)
            return CacheHit(request_id=request.request_id, num_tokens=0, blocks=self._empty_hit,
                            pool_epoch=self._pool.evictions)
        hashes, (hits, num_tokens, first) = self._find_hit(request, max_length)
        self._hit_tokens += num_tokens
        self._group_hit_tokens = list(map(add, self._group_hit_tokens, first))
        deferred = bool(num_tokens) and coordinator.may_defer and coordinator.defers(hits)
        longest = max(first)
        request.shared_prefix_boundary = longest if longest > num_tokens else 0
        policies = self.policies
        if policies.placing or request.cache_checkpoints:  # (the only lookup hook: free when placement is off)
            policies.looked_up(request, longest)
        step = coordinator.lcm_block_size  # (why the hit stops short of the next lcm boundary)
        self._limits.count(hashes, num_tokens // step * step, max_length, deferred=deferred)
        blocks = cast("tuple[tuple[BlockId, ...], ...]", tuple(map(tuple, hits))) if num_tokens else self._empty_hit
        return CacheHit(request_id=request.request_id, num_tokens=num_tokens, blocks=blocks, deferred=deferred,
                        pool_epoch=self._pool.evictions)

    def peek(self, request: KVRequest) -> int:
        """The hit `lookup` would find now, in tokens, counting nothing and leaving the request's
        junction and checkpoint stops alone (a cache-aware queue order's probe)."""
        max_length = min(request.num_tokens - 1, self.max_model_len)
        if not self._caching or max_length < self._coordinator.hit_step:
            return 0
        if self._eagle:
            return self._find_hit(request, max_length)[1][1]
        return self._probes.peek(request, max_length)

    def _find_hit(self, request: KVRequest, max_length: int) -> tuple[dict[int, list[BlockHash]],
                                                                      tuple[GroupBlocks, int, list[int]]]:
        hashes = self._hashes(request)
        if self._eagle:
            return hashes, self._coordinator.eagle_hit(hashes, request.num_tokens, max_length)
        return hashes, self._coordinator.find_longest_cache_hit(hashes, max_length)

    def protect(self, hit: CacheHit) -> None:
        """The request of `hit` waits for blocks: a value-aware eviction policy evicts its hit blocks
        last (queue-aware retention); no-op with LRU."""
        if hit.num_tokens and self.policies.marks is not None:
            ids = np.fromiter(chain.from_iterable(hit.blocks), np.int64)  # (state rows: mostly null)
            self.policies.marks.protect(ids[ids != 0].tolist())

    def protect_waiting(self, request: KVRequest, hit_tokens: int) -> None:
        """`protect` the hit of `hit_tokens` (`peek`'s answer this step) of a request still waiting,
        counting nothing: queue-aware retention keeps every queued request's prefix, not only the
        head's. With `AdmissionHeadroom.WAITING_HITS` its blocks are also kept free at admission."""
        policies = self.policies
        if policies.duel is not None:
            policies.duel.waiting(request)
        if policies.marks is None or not hit_tokens:
            return
        if self._eagle or self._coordinator.partial_hits:  # (blocks looked up whole: hits end elsewhere)
            blocks = self._find_hit(request, min(request.num_tokens - 1, self.max_model_len))[1][0]
            policies.waiting([b for group in blocks for b in group if b])
        else:
            self._probes.protect(request, hit_tokens)

    @property
    def protects(self) -> bool:
        """Whether `protect` keeps anything (a value-aware eviction policy)."""
        return self.policies.marks is not None

    # -- allocate / cache / free ----------------------------------------------------------------

    def allocate(
        self,
        request: KVRequest,
        num_new_tokens: int,
        *,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
        num_external_tokens: int = 0,
        caching: CacheTiming = CacheTiming.IMMEDIATE,
    ) -> NewBlocks | None:
        """Blocks for one step (token regions in the module docstring).

        Args:
            request: the request; `num_computed_tokens` as the engine last advanced it.
            num_new_tokens: tokens the step computes after the hit and the external tokens.
            hit: `lookup`'s answer for a new request (None: no hit, or a running request).
            num_lookahead_tokens: extra slots past the step (speculative tokens), not cached.
            num_external_tokens: tokens loaded from outside (a KV connector) after the hit.
            caching: IMMEDIATE caches the newly full blocks now; DELAYED leaves it to `cache`.

        Returns:
            The new table entries per group, or None when the pool cannot supply them (nothing
            changed; free or preempt something and retry).

        Raises:
            AllocationError: arguments that contradict the request's state.
            StaleHitError: a block of `hit` was evicted since `lookup`.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_external_tokens < 0:
            raise AllocationError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}, num_external_tokens={num_external_tokens}"
            )
        coordinator = self._coordinator
        computed = request.num_computed_tokens
        if hit is None and not num_lookahead_tokens and not num_external_tokens:  # a running request's step
            slots = coordinator.allocated.get(request.request_id)  # None: not running
            end = computed + num_new_tokens
            if slots is not None and computed <= slots and end <= self.max_model_len:
                quiet = coordinator.quiet[request.request_id]
                if computed <= quiet[0] and end <= quiet[1]:  # no new entry, release or caching
                    if end > slots:
                        coordinator.allocated[request.request_id] = end
                    return self._no_new_blocks
                if self._decodes and caching is CacheTiming.IMMEDIATE:  # one new entry per group at most
                    entries = coordinator.decode(request, computed, end, self._hashes)
                    if entries is not None:
                        if self._observer is not None:
                            self._observer.allocated(request, end)
                        return NewBlocks.of_ints(entries)
        hit_blocks = self._check_start(request, hit)
        hit_tokens = hit.num_tokens if hit is not None else 0
        first_new = computed + hit_tokens + num_external_tokens
        end = first_new + num_new_tokens
        total = end + num_lookahead_tokens
        if total > self.max_model_len:
            raise AllocationError(
                f"request {request.request_id!r} would need {total} token slots; "
                f"expected at most max_model_len={self.max_model_len}"
            )
        admitted = not coordinator.is_running(request.request_id)
        new = coordinator.allocate(request, hit_blocks, first_new, total, hit_tokens)
        if new is None:
            return None
        if self._observer is not None:
            if admitted:
                self._observer.admitted(request, hit_tokens)
            self._observer.allocated(request, end)
        if self._caching and caching is CacheTiming.IMMEDIATE:
            coordinator.cache_blocks(request, self._hashes(request), min(end, request.num_tokens))
        coordinator.update_quiet(request.request_id)
        return NewBlocks.of_ints(new)

    def cache(self, request: KVRequest, num_tokens: int) -> None:
        """Cache the full blocks among the first `num_tokens` tokens (after a DELAYED allocate,
        once the external KV has arrived).

        Args:
            request: a running request.
            num_tokens: how many of its first tokens now hold valid KV.

        Raises:
            AllocationError: the request is not running, or `num_tokens` exceeds its slots.
        """
        allocated = self._coordinator.allocated_tokens(request.request_id)
        if not self._coordinator.is_running(request.request_id) or num_tokens > allocated:
            raise AllocationError(
                f"cannot cache {num_tokens} tokens of request {request.request_id!r}: "
                f"it holds slots for {allocated} tokens"
            )
        if self._caching:
            self._coordinator.cache_blocks(request, self._hashes(request), min(num_tokens, request.num_tokens))
            self._coordinator.update_quiet(request.request_id)

    def free(self, request: KVRequest) -> None:
        """Release every block of the request, tail first (finish or preemption); no-op if it
        holds none. A preempted request restarts with `num_computed_tokens = 0`.

        Args:
            request: the request, with `num_computed_tokens` as the engine last advanced it:
                blocks it cached beyond that (a step allocated, then preempted before it ran)
                are uncached, since their KV was never written.
        """
        if self._observer is not None:
            self._observer.finished(request)
        self._probes.forget(request.request_id)
        self._coordinator.free(request)

    def block_ids(self, request_id: RequestId) -> tuple[list[BlockId], ...]:
        """The request's block table per group (0 = null block where a position is not kept).

        Raises:
            UnknownRequestError: the request holds no blocks.
        """
        if not self._coordinator.is_running(request_id):
            raise UnknownRequestError(f"request {request_id!r} holds no blocks; expected a running request")
        return tuple(cast("list[BlockId]", m.block_table(request_id, row) or []) for m, row in self._groups)

    def load_block_ids(self, request_id: RequestId, loaded_tokens: int) -> tuple[list[BlockId], ...]:
        """`block_ids` for a KV connector loading the request's first `loaded_tokens` (a block multiple):
        with one running state per request (`RunningState.FIXED`) a state group's entry at the
        loaded prefix's last block is the running block (the loaded state is where the step reads
        it), null in `block_ids`."""
        tables = self.block_ids(request_id)
        for manager in self._fixed:
            index = loaded_tokens // manager.block_size - 1
            for g in manager.group_ids:
                if 0 <= index < len(tables[g]):
                    tables[g][index] = tables[g][-1]
        return tables

    def state_steps(self, request_id: RequestId, *, start_tokens: int, end_tokens: int) -> tuple[StateStep, ...]:
        """Per state group (ascending group id; empty without state groups), where the step that
        computes tokens `[start_tokens, end_tokens)` of a running request reads its state from and
        writes its states to. Call it after that step's `allocate`: `start_tokens` is the
        `first_new` of the module docstring (computed + hit + external tokens)."""
        allocated = self._coordinator.allocated_tokens(request_id)
        if not self._coordinator.is_running(request_id):
            raise UnknownRequestError(f"request {request_id!r} holds no blocks; expected a running request")
        if not 0 <= start_tokens < end_tokens <= allocated:
            raise AllocationError(
                f"state step [{start_tokens}, {end_tokens}) of request {request_id!r} is not a step it holds "
                f"slots for; expected 0 <= start < end <= {allocated}"
            )
        return state_steps(self._groups, request_id, start_tokens, end_tokens)

    # -- cache-wide -----------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (and nothing done) while any request holds blocks."""
        return self._pool.reset_prefix_cache()

    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests."""
        return self._pool.usage()

    def group_usage(self) -> tuple[int, ...]:
        """Blocks held by requests, per group."""
        return self._pool.group_usage()

    def num_evictable(self, blocks: tuple[int, ...]) -> int:
        """How many of `blocks` (a hit's) no request holds: adopting them takes them off the free count."""
        return sum(1 for b in blocks if b and not self._pool.ref_cnt.item(b))

    def stats(self) -> ManagerStats:
        """Prefix-cache statistics since construction (lookups, query and hit tokens)."""
        policies = self.policies.stats()
        return ManagerStats(lookups=self._lookups, query_tokens=self._query_tokens, hit_tokens=self._hit_tokens,
                            group_hit_tokens=tuple(self._group_hit_tokens),
                            limited_by=self._limits.per_group(), block_copies=self._copies,
                            checkpoint_copies=sum(m.checkpoints_copied for m in self._fixed),
                            checkpoints_skipped=sum(m.checkpoints_skipped for m in self._fixed),
                            state_adoptions=policies.state_adoptions, anchor_reuse=policies.anchor_reuse)

    def take_pending_copies(self) -> tuple[BlockCopy, ...]:
        """The block copies the engine must run before the next forward, in order (copy on write
        of partial hits, docs/prefix_caching.md): each copies every page of `src_block_id` to
        `dst_block_id` (one group). Call once per step, after its last `allocate`; the blocks the
        copies read stay allocated until this call. Empty unless partial hits are on."""
        copies = self._coordinator.cow.take()
        self._copies += len(copies)
        return tuple(map(BlockCopy._make, copies)) if self._answers else ()  # (ints as the ids' NewTypes)

    def take_checkpoint_copies(self) -> tuple[BlockCopy, ...]:
        """The copies the engine must run AFTER the next forward (`RunningState.FIXED`): each copies
        a request's running state out into a checkpoint block, cached and free (running_state.py).
        Call once per step, after `take_pending_copies`. Empty unless running_state is FIXED."""
        if not self._answers:
            for manager in self._fixed:
                manager.settle_checkpoints()
            return ()
        copies = chain.from_iterable(m.take_checkpoints() for m in self._fixed)  # (group, src, dst) ints
        return tuple(map(tuple.__new__, repeat(BlockCopy), copies))  # (a named tuple each, built in C)

    def take_events(self) -> list[KVEvent]:
        """KV events (stored / removed / cleared) since the last call; empty unless events ON."""
        return self._pool.take_events()

    @property
    def type_managers(self) -> tuple[SingleTypeManager, ...]:
        """The managers below this one, one per hit rule (read-only inspection: tests, reports)."""
        return self._coordinator.managers

    def check_integrity(self) -> None:
        """Raise `IntegrityError` with the actual numbers if any invariant is broken: ref counts
        equal the number of tables holding a block, free queue == blocks with ref count 0, no
        block twice in a table, every held block belongs to the group holding it, hash maps
        consistent."""
        check_manager_integrity(self._groups, self._coordinator, self._pool)

    # -- internals ------------------------------------------------------------------------------

    def _hashes(self, request: KVRequest) -> dict[int, list[BlockHash]]:
        hashes = request.block_hashes
        num_tokens = request.num_tokens
        for size in self._block_sizes:
            known = hashes.get(size)
            if known is None or len(known) < num_tokens // size:
                self._hasher.update(request, size)
        return hashes

    def _check_start(self, request: KVRequest, hit: CacheHit | None) -> GroupBlocks | None:
        """The hit's blocks per group (None without a hit) once the request's state agrees with
        them; `AllocationError` where it contradicts the step (`hit_checks.py`)."""
        coordinator = self._coordinator
        running = coordinator.is_running(request.request_id)
        if hit is not None and hit.num_tokens:
            groups = resolve_hit(request, hit, running=running, block_sizes=self._group_block_sizes,
                                 num_blocks=self._pool.num_blocks)
            if hit.pool_epoch != self._pool.evictions:
                verify_hit(request, groups, hit.num_tokens, hashes=self._hashes(request), pool=self._pool,
                           block_sizes=self._group_block_sizes, unit=self.match_unit.hash_unit_tokens)
            return groups
        check_no_hit_start(request, running=running, allocated=coordinator.allocated_tokens(request.request_id))
        return None
