"""How a `KVCacheManager` assembles its parts: one type manager per hit rule, and the coordinator."""

from __future__ import annotations

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.coordinator import (
    HybridCoordinator,
    KVCacheCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
)
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.policies import CachePolicies
from hybridkv.kvcache.retention import Retention
from hybridkv.kvcache.running_state import FixedStateManager
from hybridkv.kvcache.type_managers.attention import make_manager
from hybridkv.kvcache.type_managers.base import SingleTypeManager, rule_of
from hybridkv.plan.planner import KVCacheConfig, KVCacheGroupSpec
from hybridkv.plan.specs import MambaCacheMode, SpecKind


def make_type_managers(config: KVCacheConfig, pool: BlockPool, options: CacheOptions,
                   retention: Retention) -> list[SingleTypeManager]:
    """One type manager per hit rule (its groups), in first-group order."""
    mode = options.mamba_cache_mode if options.caching else MambaCacheMode.NONE
    by_rule: dict[tuple[object, ...], list[KVCacheGroupSpec]] = {}
    for group in config.groups:
        by_rule.setdefault(rule_of(group), []).append(group)
    fixed = options.running_state.one_state and mode is MambaCacheMode.ALIGN
    return [FixedStateManager(groups, pool, retention=retention) if fixed and groups[0].kind is SpecKind.MAMBA
            else make_manager(groups, pool, mamba_mode=mode, retention=retention) for groups in by_rule.values()]


def make_coordinator(managers: list[SingleTypeManager], pool: BlockPool, options: CacheOptions,
                      policies: CachePolicies) -> KVCacheCoordinator:
    if not options.caching:
        return NoPrefixCacheCoordinator(managers, pool, release_order=options.release_order)
    kind = UnitaryCoordinator if len(managers) == 1 else HybridCoordinator
    return kind(managers, pool, release_order=options.release_order, reserve=policies.reserve,
                adoption=policies.adoption)
