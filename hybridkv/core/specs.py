"""Layer cache specs: what one layer needs cached, and the byte math on it.

A layer spec says *what* a layer keeps (K/V of some attention type, or a recurrent state) and
how large one token or one state is. It deliberately carries no block size: the planner picks
the block size of each KV cache group, and the page of a group follows from spec + block size.

    attention page = 2 (K and V) * block_size * kv_heads * head_dim * dtype_bytes
    mamba page     = sum over the state tensors of prod(shape) * dtype_bytes   (no block size)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from hybridkv.core.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of `dtype`; raises ConfigError listing the known dtypes."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}"
        ) from None


class SpecKind(Enum):
    """The attention type of a layer; also the `kind` of a KV cache group."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    CROSS = "cross"


class MambaCacheMode(Enum):
    """How state groups (Mamba, Gated DeltaNet) are prefix-cached (vLLM's `mamba_cache_mode`).

    ALIGN: a checkpoint only where a step ends on a block boundary (the engine cuts prefill
    chunks there). ALL: a checkpoint at every block boundary a step crosses. With prefix caching
    off, state groups keep one running state (vLLM's `none`); no member is needed for that.
    """

    ALIGN = "align"
    ALL = "all"


class MambaType(Enum):
    """Which recurrent layer a Mamba-style state belongs to (their state shapes differ)."""

    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GATED_DELTANET = "gated_deltanet"


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSpec:
    """K/V cache of one attention layer: full, sliding window, chunked local or cross.

    `window_tokens` (sliding only): a query attends to the last `window_tokens` positions
    including itself, so `window_tokens - 1` earlier tokens must stay cached.
    `chunk_tokens` (chunked local only): a query attends to the positions of its own chunk.
    """

    kind: SpecKind
    num_kv_heads: int
    head_dim: int
    dtype: str
    window_tokens: int = 0
    chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind is SpecKind.MAMBA:
            raise ConfigError("AttentionSpec cannot have kind mamba; use MambaSpec")
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        dtype_bytes(self.dtype)
        if self.kind is SpecKind.SLIDING_WINDOW:
            _positive("window_tokens of a sliding-window layer", self.window_tokens)
        elif self.window_tokens:
            raise ConfigError(
                f"window_tokens={self.window_tokens} is only valid for sliding_window, got {self.kind.value}"
            )
        if self.kind is SpecKind.CHUNKED_LOCAL:
            _positive("chunk_tokens of a chunked-local layer", self.chunk_tokens)
        elif self.chunk_tokens:
            raise ConfigError(
                f"chunk_tokens={self.chunk_tokens} is only valid for chunked_local, got {self.kind.value}"
            )

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token in this layer."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block of this layer."""
        return block_size * self.bytes_per_token

    def blocks_needed(self, *, block_size: int, max_model_len: int, max_num_batched_tokens: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN) -> int:
        """Most blocks one request of `max_model_len` tokens holds at once in this layer."""
        del mamba_cache_mode
        if self.kind is SpecKind.SLIDING_WINDOW:
            live = min(self.window_tokens - 1 + max_num_batched_tokens, max_model_len)
            return math.ceil(live / block_size) + 1
        if self.kind is SpecKind.CHUNKED_LOCAL:
            live = min(self.chunk_tokens + max_num_batched_tokens, max_model_len)
            return math.ceil(live / block_size) + 1
        return math.ceil(max_model_len / block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class MambaSpec:
    """Recurrent state of one Mamba1 / Mamba2 / Gated DeltaNet layer.

    `shapes[i]` and `dtypes[i]` describe state tensor i (conv first, then recurrent), sized the
    vLLM way: the conv state keeps `conv_kernel - 1` columns (transformers keeps `conv_kernel`).
    """

    mamba_type: MambaType
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ConfigError(
                f"MambaSpec needs one dtype per state tensor, got {len(self.shapes)} shapes "
                f"and {len(self.dtypes)} dtypes"
            )
        for shape in self.shapes:
            for dim in shape:
                _positive(f"state dimension in {shape}", dim)
        for dtype in self.dtypes:
            dtype_bytes(dtype)

    @property
    def kind(self) -> SpecKind:
        return SpecKind.MAMBA

    @property
    def state_bytes(self) -> int:
        """Bytes of the whole state of one request in this layer (the unpadded page)."""
        return sum(math.prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes, strict=True))

    def page_size_bytes(self, block_size: int) -> int:
        """The state is one page whatever the block size."""
        del block_size
        return self.state_bytes

    def blocks_needed(self, *, block_size: int, max_model_len: int, max_num_batched_tokens: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN) -> int:
        """Most state blocks one request holds at once (what the KV cache manager really holds).

        ALIGN: the state the step reads plus the one it writes: 2 blocks. ALL: the state the
        step reads plus one block per boundary a step of `max_num_batched_tokens` crosses (and
        the running state after it): `ceil(max_num_batched_tokens / B) + 1`, at most the
        `ceil(max_model_len / B)` entries of a table.
        """
        if mamba_cache_mode is MambaCacheMode.ALIGN:
            return 2
        return min(math.ceil(max_num_batched_tokens / block_size) + 1, math.ceil(max_model_len / block_size))


LayerSpec = AttentionSpec | MambaSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Per-layer cache specs of one model, read from its config.json.

    `layers[i]` is the spec of decoder layer i. `kv_shared_from[i] = j` says layer i reads the
    K/V of layer j and gets no memory of its own (Gemma 3n, Gemma 4). Layers without any cache
    (e.g. pure MLP layers of Nemotron-H) are listed in `cacheless_layers` and have no spec.

    A decoder layer with both an attention K/V cache and a recurrent state (Falcon-H1, Zamba2's
    hybrid layers) keeps its attention spec at its own index and its state in an extra cache
    slot after the decoder layers: `decoder_layer_of[slot] = i` for each slot
    `num_decoder_layers <= slot < len(layers)` (empty for every other model).
    """

    name: str
    model_type: str
    dtype: str
    layers: tuple[LayerSpec | None, ...]
    kv_shared_from: dict[int, int]
    max_position_embeddings: int
    decoder_layer_of: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError(f"model {self.name!r} has no layers")
        first_slot = len(self.layers) - len(self.decoder_layer_of)
        for slot, layer in self.decoder_layer_of.items():
            in_range = first_slot <= slot < len(self.layers) and 0 <= layer < first_slot
            if not in_range or self.layers[slot] is None:
                raise ConfigError(
                    f"extra cache slot {slot} of decoder layer {layer} is invalid: slots must be "
                    f"{first_slot}..{len(self.layers) - 1}, after the {first_slot} decoder layers, and own a spec"
                )
        for i, j in self.kv_shared_from.items():
            if not (0 <= j < len(self.layers)) or self.layers[j] is None or j in self.kv_shared_from:
                raise ConfigError(f"layer {i} shares the KV of layer {j}, which owns no KV cache")

    @property
    def num_layers(self) -> int:
        """Cache slots: the decoder layers plus any extra state slots (see `decoder_layer_of`)."""
        return len(self.layers)

    @property
    def num_decoder_layers(self) -> int:
        return len(self.layers) - len(self.decoder_layer_of)

    @property
    def cacheless_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.layers) if s is None)

    def owned_layers(self) -> list[tuple[int, LayerSpec]]:
        """(layer index, spec) of every layer that owns cache memory, in layer order."""
        return [
            (i, s) for i, s in enumerate(self.layers) if s is not None and i not in self.kv_shared_from
        ]
