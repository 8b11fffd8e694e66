"""DeepSeek-V4's packed layout: several groups of mixed pages in one block-outermost buffer.

vLLM 0.32 lays out a model whose caches have different page sizes, on backends that declare a
block-outermost layout (DeepSeek-V4's), as `_get_packed_kv_cache_groups` does:

    bucket the caches greedily (first fit) by type: same block size, kind and window
    --> a bucket is *balanced* when each of its page sizes has as many caches (a repeating pattern)
    --> repeats per group = the d >= the largest mixed balanced bucket's count that pads the
        balanced buckets' counts least (ties: the larger d); a balanced bucket of n repeats
        becomes ceil(n / d) groups by stride over its pattern; any other bucket stays whole
    --> one buffer: block b of every group is bytes [b * S, (b + 1) * S), S = the largest
        group's block total; smaller groups leave the rest of their block empty

DeepSeek-V4-Flash: 43 window caches (block 64, 22 + 21 layers), compressed latents + indexer keys
(block 256), ratio-4 compressor + indexer-compressor states (block 4), ratio-128 compressor states
(block 8): 5 groups.
"""

from __future__ import annotations

import math

from hybridkv.plan.specs import LayerSpec

Slot = tuple[int, LayerSpec]


def _type_key(spec: LayerSpec, block_size: int) -> tuple[int, str, int]:
    window = getattr(spec, "window_tokens", 0)
    return block_size, spec.kind.value, window


def approximate_gcd(values: list[int], *, lower_bound: int) -> int:
    """The d in [lower_bound, max(values)] that pads `values` up to multiples of d least; ties: larger d."""
    best, best_pad = lower_bound, -1
    for d in range(max(1, lower_bound), max(values) + 1):
        pad = sum(-x % d for x in values)
        if best_pad < 0 or pad <= best_pad:
            best, best_pad = d, pad
    return best


def _by_page(bucket: list[Slot], block_size: int) -> dict[int, list[Slot]]:
    pages: dict[int, list[Slot]] = {}
    for slot in bucket:
        pages.setdefault(slot[1].page_size_bytes(block_size), []).append(slot)
    return pages


def packed_groups(owned: list[Slot], block_size_of: dict[int, int]) -> list[list[Slot]]:
    """Caches (slot, spec) in registration order -> the groups, each a list of caches in order."""
    buckets: list[list[Slot]] = []
    for slot, spec in owned:
        key = _type_key(spec, block_size_of[slot])
        for bucket in buckets:
            if _type_key(bucket[0][1], block_size_of[bucket[0][0]]) == key:
                bucket.append((slot, spec))
                break
        else:
            buckets.append([(slot, spec)])
    pages = [_by_page(b, block_size_of[b[0][0]]) for b in buckets]
    balanced = [len({len(v) for v in p.values()}) == 1 for p in pages]
    repeats = [max(len(v) for v in p.values()) for p in pages]
    floor = max((r for r, p, ok in zip(repeats, pages, balanced, strict=True) if ok and len(p) > 1), default=0)
    per_group = approximate_gcd([r for r, ok in zip(repeats, balanced, strict=True) if ok],
                                lower_bound=floor) if floor else 0
    groups: list[list[Slot]] = []
    for bucket, page, ok, count in zip(buckets, pages, balanced, repeats, strict=True):
        n = math.ceil(count / per_group) if ok and per_group else 1
        if n == 1:
            groups.append(bucket)
            continue
        pattern = list(zip(*page.values(), strict=True))
        groups.extend([slot for repeat in pattern[i::n] for slot in repeat] for i in range(n))
    return groups
