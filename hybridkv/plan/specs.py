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

from hybridkv.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,  # opaque packed bytes (the DSA indexer cache: fp8 values, then fp32 scales)
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
    chunks there). ALL: a checkpoint at every block boundary a step crosses. NONE: one running
    state, never cached (what state groups get whenever prefix caching is off).
    """

    ALIGN = "align"
    ALL = "all"
    NONE = "none"


class MambaType(Enum):
    """Which recurrent layer a Mamba-style state belongs to (their state shapes differ; all are hit and
    checkpointed by the same rules, as vLLM keeps them all in its MambaSpec)."""

    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GATED_DELTANET = "gated_deltanet"
    SHORT_CONV = "short_conv"  # LFM2: a convolution state only
    KDA = "kda"  # Kimi Delta Attention (Kimi-Linear)
    LIGHTNING = "lightning"  # MiniMax-Text-01's lightning attention: one (H, D, D) state, no conv
    RG_LRU = "rg_lru"  # RecurrentGemma's real-gated linear recurrence: conv + a (width,) state


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSpec:
    """K/V cache of one attention layer: full, sliding window, chunked local or cross.

    `window_tokens` (sliding only): a query attends to the last `window_tokens` positions
    including itself, so `window_tokens - 1` earlier tokens must stay cached.
    `chunk_tokens` (chunked local only): a query attends to the positions of its own chunk.
    `value_head_dim`: the V head size where it differs from the K head size `head_dim` (MiMo-V2-Flash:
    K 192, V 128; vLLM's `head_size_v`); 0 means equal.
    """

    kind: SpecKind
    num_kv_heads: int
    head_dim: int
    dtype: str
    window_tokens: int = 0
    chunk_tokens: int = 0
    value_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind is SpecKind.MAMBA:
            raise ConfigError("AttentionSpec cannot have kind mamba; use MambaSpec")
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        if self.value_head_dim < 0:
            raise ConfigError(f"value_head_dim must be 0 (same as head_dim) or positive, got {self.value_head_dim}")
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
        return self.num_kv_heads * (self.head_dim + (self.value_head_dim or self.head_dim)) * dtype_bytes(self.dtype)

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

        NONE: the running state: 1 block. ALIGN: the state the step reads plus the one it
        writes: 2 blocks. ALL: the state the step reads plus one block per boundary a step of
        `max_num_batched_tokens` crosses (and
        the running state after it): `ceil(max_num_batched_tokens / B) + 1`, at most the
        `ceil(max_model_len / B)` entries of a table.
        """
        if mamba_cache_mode is MambaCacheMode.NONE:
            return 1
        if mamba_cache_mode is MambaCacheMode.ALIGN:
            return 2
        return min(math.ceil(max_num_batched_tokens / block_size) + 1, math.ceil(max_model_len / block_size))


class MLAFormat(Enum):
    """How an MLA latent is stored: in the cache dtype, or one of the sparse backends' packed formats.

    `fp8_ds_mla` (FlashMLA sparse): 512 fp8 latent values + 4 fp32 scales + 64 bf16 rope values = 656 B;
    `nvfp4_ds_mla`: 352 B. Both exist only for kv_lora_rank 512 + qk_rope_head_dim 64 (vLLM
    `MLAAttentionSpec.real_page_size_bytes`, `vllm/v1/attention/backends/mla/flashmla_sparse.py`).
    """

    NATIVE = "native"
    FP8_DS_MLA = "fp8_ds_mla"
    NVFP4_DS_MLA = "nvfp4_ds_mla"


_PACKED_MLA_BYTES = {MLAFormat.FP8_DS_MLA: 656, MLAFormat.NVFP4_DS_MLA: 352}


def _blocks_for(kind: SpecKind, window_tokens: int, *, block_size: int, max_model_len: int,
                max_num_batched_tokens: int) -> int:
    if kind is SpecKind.SLIDING_WINDOW:
        live = min(window_tokens - 1 + max_num_batched_tokens, max_model_len)
        return math.ceil(live / block_size) + 1
    return math.ceil(max_model_len / block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class MLASpec:
    """Multi-head latent attention cache of one layer: one latent per token, no K/V split.

    A token stores `kv_lora_rank + qk_rope_head_dim` values (576 for DeepSeek-V3) in `dtype`, or a
    packed sparse-backend format. There is one KV head, replicated on every TP rank. `kind` is
    full (DeepSeek-V3/V3.2, GLM-5) or sliding window (DeepSeek-V4's window cache).
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str
    cache_format: MLAFormat = MLAFormat.NATIVE
    kind: SpecKind = SpecKind.FULL
    window_tokens: int = 0

    def __post_init__(self) -> None:
        _positive("kv_lora_rank", self.kv_lora_rank)
        _positive("qk_rope_head_dim", self.qk_rope_head_dim)
        dtype_bytes(self.dtype)
        if self.kind not in (SpecKind.FULL, SpecKind.SLIDING_WINDOW):
            raise ConfigError(f"an MLA cache is full or sliding_window attention, got {self.kind.value}")
        if self.kind is SpecKind.SLIDING_WINDOW:
            _positive("window_tokens of a sliding-window MLA layer", self.window_tokens)
        elif self.window_tokens:
            raise ConfigError(f"window_tokens={self.window_tokens} is only valid for a sliding_window MLA layer")
        if self.cache_format is not MLAFormat.NATIVE and (self.kv_lora_rank, self.qk_rope_head_dim) != (512, 64):
            raise ConfigError(
                f"the {self.cache_format.value} MLA format stores kv_lora_rank 512 + qk_rope_head_dim 64, "
                f"got {self.kv_lora_rank} + {self.qk_rope_head_dim}"
            )

    @property
    def head_dim(self) -> int:
        """Values of one latent: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's latent in this layer."""
        packed = _PACKED_MLA_BYTES.get(self.cache_format)
        return packed if packed is not None else self.head_dim * dtype_bytes(self.dtype)

    def page_size_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def blocks_needed(self, *, block_size: int, max_model_len: int, max_num_batched_tokens: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN) -> int:
        del mamba_cache_mode
        return _blocks_for(self.kind, self.window_tokens, block_size=block_size, max_model_len=max_model_len,
                           max_num_batched_tokens=max_num_batched_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerSpec:
    """Key-only cache of a sparse-attention indexer (DeepSeek-V3.2 / GLM-5 DSA, MiniMax-M3).

    A token stores `entry_size` elements of `dtype`: DSA packs `index_head_dim` fp8 values then
    one fp32 scale per 128 values into uint8 (`index_head_dim + index_head_dim // 128 * 4` =
    132 bytes for head dim 128); MiniMax-M3 stores `sparse_index_dim` bf16 values. It is laid out
    like full attention (one vector per token, one head, never split by TP).
    """

    entry_size: int
    dtype: str

    def __post_init__(self) -> None:
        _positive("indexer entry_size", self.entry_size)
        dtype_bytes(self.dtype)

    @property
    def kind(self) -> SpecKind:
        return SpecKind.FULL

    @property
    def bytes_per_token(self) -> int:
        return self.entry_size * dtype_bytes(self.dtype)

    def page_size_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def blocks_needed(self, *, block_size: int, max_model_len: int, max_num_batched_tokens: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN) -> int:
        del max_num_batched_tokens, mamba_cache_mode
        return math.ceil(max_model_len / block_size)


class LatentRole(Enum):
    """Which of DeepSeek-V4's caches a `CompressedMLASpec` is (one decoder layer has up to five)."""

    WINDOW = "swa"  # the latents of the last `sliding_window` tokens
    COMPRESSED = "compressed"  # one latent per `tokens_per_state` tokens
    COMPRESSOR = "compressor"  # the compressor's running kv + score state (fp32)
    INDEXER = "indexer"  # the compressed indexer keys (ratio-4 layers)
    INDEXER_COMPRESSOR = "indexer-compressor"  # the indexer compressor's running state


@dataclass(frozen=True, slots=True, kw_only=True)
class CompressedMLASpec:
    """One DeepSeek-V4 cache: rows of `entry_bytes`, one per `tokens_per_state` tokens, in pages of a
    block size the model's kernels fix (vLLM 0.32's `SlidingWindowMLASpec` / `MLAAttentionSpec` with
    `tokens_per_state` and `alignment`).

        page = round_up(block_size // tokens_per_state * entry_bytes, alignment_bytes)

    `kind` is sliding window (the window latents, the compressor states) or full (compressed latents
    and indexer keys); the KV cache manager treats them with the ordinary rules of that kind.
    """

    role: LatentRole
    kind: SpecKind
    block_size: int
    entry_bytes: int
    tokens_per_state: int = 1
    window_tokens: int = 0
    alignment_bytes: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size", "entry_bytes", "tokens_per_state", "alignment_bytes"):
            _positive(f"{self.role.value} cache {name}", getattr(self, name))
        if self.block_size % self.tokens_per_state:
            raise ConfigError(f"{self.role.value} cache: block_size {self.block_size} must be a multiple of "
                              f"tokens_per_state {self.tokens_per_state}")
        if self.kind is SpecKind.SLIDING_WINDOW:
            _positive(f"window_tokens of the {self.role.value} cache", self.window_tokens)
        elif self.kind is not SpecKind.FULL or self.window_tokens:
            raise ConfigError(f"a {self.role.value} cache is full (no window) or sliding_window, "
                              f"got {self.kind.value} with window {self.window_tokens}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one stored row (`entry_bytes`; a row covers `tokens_per_state` tokens)."""
        return self.entry_bytes

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block: its rows, padded up to `alignment_bytes`."""
        rows = block_size // self.tokens_per_state * self.entry_bytes
        return -(-rows // self.alignment_bytes) * self.alignment_bytes

    def blocks_needed(self, *, block_size: int, max_model_len: int, max_num_batched_tokens: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN) -> int:
        del mamba_cache_mode
        return _blocks_for(self.kind, self.window_tokens, block_size=block_size, max_model_len=max_model_len,
                           max_num_batched_tokens=max_num_batched_tokens)


TokenSpec = AttentionSpec | MLASpec | IndexerSpec  # specs whose page grows with the block size
LayerSpec = AttentionSpec | MambaSpec | MLASpec | IndexerSpec | CompressedMLASpec


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Per-layer cache specs of one model, read from its config.json.

    `layers[i]` is the spec of decoder layer i. `kv_shared_from[i] = j` says layer i reads the
    K/V of layer j and gets no memory of its own (Gemma 3n, Gemma 4). Layers without any cache
    (e.g. pure MLP layers of Nemotron-H) are listed in `cacheless_layers` and have no spec.

    A decoder layer with both an attention K/V cache and a recurrent state (Falcon-H1, Zamba2's
    hybrid layers) keeps its attention spec at its own index and its state in an extra cache
    slot after the decoder layers: `decoder_layer_of[slot] = i` for each slot
    `num_decoder_layers <= slot < len(layers)` (empty for every other model). The same slots
    hold the key-only indexer caches of sparse-attention layers (DeepSeek-V3.2, GLM-5, MiniMax-M3).

    `kernel_block_size` is the block size the model's attention kernels require, whatever the
    user asks (sparse MLA: 64, MiniMax-M3's sparse attention: 128); `kernel_backend` names them.
    """

    name: str
    model_type: str
    dtype: str
    layers: tuple[LayerSpec | None, ...]
    kv_shared_from: dict[int, int]
    max_position_embeddings: int
    decoder_layer_of: dict[int, int] = field(default_factory=dict)
    kernel_block_size: int | None = None
    kernel_backend: str = ""

    def __post_init__(self) -> None:
        if self.kernel_block_size is not None:
            _positive("kernel_block_size", self.kernel_block_size)
            if not self.kernel_backend:
                raise ConfigError(f"model {self.name!r}: a kernel_block_size needs the kernel_backend that forces it")
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
