"""The request as the KV cache manager sees it.

The engine owns the request's lifecycle: it appends generated tokens to `token_ids` and advances
`num_computed_tokens` after each step. The manager only reads those two fields, and extends
`block_hashes` (one chained hash per full block, per block size) as the tokens grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.errors import ConfigError
from hybridkv.kvcache.ids import BlockHash, RequestId


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiModalFeature:
    """One multimodal item (an image, an audio clip) occupying placeholder tokens of the prompt.

    `identifier` is the content hash of the item (computed by the engine's processor); every
    block that overlaps `[offset_tokens, offset_tokens + length_tokens)` includes it in its hash,
    so two prompts with identical placeholder tokens but different images never share blocks.
    """

    identifier: str
    offset_tokens: int
    length_tokens: int

    def __post_init__(self) -> None:
        if self.offset_tokens < 0 or self.length_tokens <= 0:
            raise ConfigError(
                f"multimodal item {self.identifier!r} must have offset >= 0 and length > 0, "
                f"got offset {self.offset_tokens} and length {self.length_tokens}"
            )


@dataclass(slots=True, kw_only=True)
class KVRequest:
    """The manager-facing state of one request.

    `block_hashes[block_size]` holds the hash of every full block computed so far at that block
    size; it is filled lazily by `BlockHasher.update` (the manager calls it, an engine may call
    it earlier, off the scheduling hot path). `num_encoder_tokens` sizes cross-attention groups.
    """

    request_id: RequestId
    token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    mm_features: tuple[MultiModalFeature, ...] = ()
    num_encoder_tokens: int = 0
    block_hashes: dict[int, list[BlockHash]] = field(default_factory=dict)
    #: set by `lookup` (vLLM's `request.shared_prefix_boundary`): where the longest single-group
    #: hit ends when it is longer than the hit every group serves (a Marconi-style junction: the
    #: prefix is shared but some group kept no state there), else 0. The scheduler ends an align-mode
    #: chunk at it (block-floored) so the state there is checkpointed; a sparse sliding-window
    #: retention keeps the window tail before it.
    shared_prefix_boundary: int = 0
    #: the prompt's length: set by the manager when it first sees the request (its tokens then), kept
    #: across preemption; sparse retention keeps the states a resend of the prompt would read
    num_prompt_tokens: int | None = None
    #: token positions where a later hit is expected (an application's `cache_checkpoints` hint, or
    #: the ends of a chat's turns): align-mode chunks end there, so a state checkpoint exists, and a
    #: value-aware eviction keeps the window tails and checkpoints there (`policies/anchors.py`)
    cache_checkpoints: tuple[int, ...] = ()
    #: set by `lookup` from the checkpoint placement: where align-mode chunks must end (the
    #: scheduler reads it with `shared_prefix_boundary`)
    checkpoint_stops: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens known so far."""
        return len(self.token_ids)
