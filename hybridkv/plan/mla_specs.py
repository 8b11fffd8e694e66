"""Readers for the latent-attention (MLA) and sparse-attention families.

    DeepSeek-V2/V3, Kimi-K2   one MLA latent per layer (`kv_lora_rank + qk_rope_head_dim` values)
    DeepSeek-V3.2, GLM-5      MLA + a key-only DSA indexer cache on the layers that own an indexer
    MiniMax-M3                GQA K/V + a key-only indexer cache on the sparse layers
    DeepSeek-V4               window latents + compressed latents, compressor states, indexer (5 groups)

Facts follow vLLM 0.32: the MLA latent has one KV head replicated on every TP rank; the DSA
indexer stores `index_head_dim` fp8 values then one fp32 scale per 128 values as uint8
(`DeepseekV32IndexerCache`: 132 bytes for head dim 128); MiniMax-M3's indexer stores
`sparse_index_dim` bf16 values (`MiniMaxM3IndexerCache`). The sparse kernels force the block size:
64 for sparse MLA (FLASHMLA_SPARSE), 128 for MiniMax-M3. `--kv-cache-dtype fp8` becomes the
`fp8_ds_mla` format (656 B per token) on sparse-MLA models, as vLLM's
`DeepseekV32ForCausalLM.verify_and_update_config` does.

The indexer caches go in extra cache slots after the decoder layers, like the second caches of
Falcon-H1 (`ModelSpec.decoder_layer_of`), so slot `num_layers + k` is the k-th indexer.
"""

from __future__ import annotations

from hybridkv.errors import ConfigError
from hybridkv.plan.config_fields import FamilyLayers, IndexerFormat, KVCacheDType, LayerRole, SpecContext
from hybridkv.plan.specs import CompressedMLASpec, IndexerSpec, LatentRole, LayerSpec, MLAFormat, MLASpec, SpecKind

SPARSE_MLA_BLOCK_SIZE = 64
SPARSE_MLA_BACKEND = "FLASHMLA_SPARSE"
MINIMAX_M3_BLOCK_SIZE = 128
MINIMAX_M3_BACKEND = "MINIMAX_M3_SPARSE"
SPARSE_MLA_MODEL_TYPES = frozenset({"deepseek_v32", "glm_moe_dsa"})
_DS_FORMATS = {KVCacheDType.FP8_DS_MLA: MLAFormat.FP8_DS_MLA, KVCacheDType.NVFP4_DS_MLA: MLAFormat.NVFP4_DS_MLA}
_DSA_QUANT_BLOCK = 128  # the indexer keeps one fp32 scale per 128 fp8 values


def check_kv_cache_dtype(model_type: str, kv_cache_dtype: KVCacheDType, *, sparse_mla: bool) -> None:
    """The packed `*_ds_mla` formats exist only for sparse-MLA models; raise ConfigError otherwise."""
    if kv_cache_dtype in _DS_FORMATS and not sparse_mla:
        raise ConfigError(
            f"kv_cache_dtype {kv_cache_dtype.value!r} is a sparse-MLA cache format (DeepSeek-V3.2, GLM-5); "
            f"model_type {model_type!r} has no sparse MLA layer; expected 'auto' or 'fp8'"
        )


def _mla_spec(ctx: SpecContext, *, sparse: bool) -> MLASpec:
    """The latent cache of one MLA layer (never split by TP: one head, replicated)."""
    cfg, choice = ctx.cfg, ctx.options.kv_cache_dtype
    check_kv_cache_dtype(cfg.model_type, choice, sparse_mla=sparse)
    fmt = _DS_FORMATS.get(choice, MLAFormat.NATIVE)
    if sparse and choice is KVCacheDType.FP8:
        fmt = MLAFormat.FP8_DS_MLA
    dtype = "fp8" if choice is KVCacheDType.FP8 and fmt is MLAFormat.NATIVE else ctx.dtype
    return MLASpec(kv_lora_rank=cfg.require_int("kv_lora_rank"), qk_rope_head_dim=cfg.require_int("qk_rope_head_dim"),
                   dtype=dtype, cache_format=fmt)


def dsa_indexer_layers(ctx: SpecContext) -> list[bool]:
    """Which layers own a DSA indexer (and so an indexer cache); the others reuse an earlier top-k.

    `indexer_types` ("full" owns, "shared" reuses; GLM-5.2's saved form) wins, then
    `index_topk_pattern` ("F" owns, "S" skips, one letter per layer), then the rule
    `skip = max(layer - index_skip_topk_offset + 1, 0) % index_topk_freq != 0` (defaults 2 and 1:
    every layer owns one), as vLLM's deepseek_v32 attention and transformers' GlmMoeDsaConfig read it.
    """
    cfg, n = ctx.cfg, ctx.num_layers
    types = cfg.str_list("indexer_types")
    if types is not None:
        if len(types) != n or set(types) - {"full", "shared"}:
            raise cfg.error(f"field 'indexer_types' must list {n} entries 'full' or 'shared', got {types!r}")
        return [t == "full" for t in types]
    pattern = cfg.raw("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) != n or set(pattern) - {"F", "S"}:
            raise cfg.error(f"field 'index_topk_pattern' must be a string of {n} letters 'F' (own indexer) "
                            f"or 'S' (shared top-k), got {pattern!r}")
        return [letter == "F" for letter in pattern]
    freq = cfg.get_int("index_topk_freq", default=1)
    offset = cfg.get_int("index_skip_topk_offset", default=2, minimum=0)
    return [max(i - offset + 1, 0) % freq == 0 for i in range(n)]


def _indexer_slots(owners: list[bool], spec: IndexerSpec) -> tuple[tuple[int, LayerSpec], ...]:
    return tuple((i, spec) for i, owns in enumerate(owners) if owns)


def read_deepseek_mla(ctx: SpecContext) -> FamilyLayers:
    """DeepSeek-V2/V3, Kimi-K2 (dense MLA); DeepSeek-V3.2 and GLM-5 (sparse MLA + DSA indexer).

    A config is sparse when its model_type is deepseek_v32 / glm_moe_dsa or it sets `index_topk`
    (vLLM's own test). Sparse layouts put latents and indexer keys in one group of block 64.
    """
    cfg = ctx.cfg
    sparse = cfg.model_type in SPARSE_MLA_MODEL_TYPES or cfg.has("index_topk")
    mla = _mla_spec(ctx, sparse=sparse)
    layers: tuple[LayerSpec | None, ...] = (mla,) * ctx.num_layers
    if not sparse:
        return FamilyLayers(layers=layers)
    head_dim = cfg.require_int("index_head_dim")
    if ctx.options.indexer is IndexerFormat.UNQUANTIZED:
        indexer = IndexerSpec(entry_size=head_dim, dtype=ctx.dtype)
    else:
        indexer = IndexerSpec(entry_size=head_dim + head_dim // _DSA_QUANT_BLOCK * 4, dtype="uint8")
    return FamilyLayers(layers=layers, second_caches=_indexer_slots(dsa_indexer_layers(ctx), indexer),
                        kernel_block_size=SPARSE_MLA_BLOCK_SIZE, kernel_backend=SPARSE_MLA_BACKEND)


def read_longcat(ctx: SpecContext) -> FamilyLayers:
    """LongCat-Flash: two MLA attentions per decoder layer (vLLM's `self_attn[0]` and `self_attn[1]`),
    the second in an extra cache slot of the same layer."""
    one = read_deepseek_mla(ctx)
    return FamilyLayers(layers=one.layers,
                        second_caches=tuple((i, spec) for i, spec in enumerate(one.layers) if spec is not None))


def minimax_sparse_layers(ctx: SpecContext) -> list[bool]:
    """MiniMax-M3 layers with an indexer: `layer_types[i] == "minimax_m3_sparse"` (transformers' saved
    form), else `sparse_attention_config.sparse_attention_freq[i] != 0` (the Hub form; none when absent,
    as vLLM reads it)."""
    cfg, n = ctx.cfg, ctx.num_layers
    types = cfg.str_list("layer_types")
    if types is not None:
        if len(types) != n or set(types) - {"full_attention", "minimax_m3_sparse"}:
            raise cfg.error(f"field 'layer_types' must list {n} entries 'full_attention' or 'minimax_m3_sparse', "
                            f"got {types!r}")
        return [t == "minimax_m3_sparse" for t in types]
    sparse = cfg.sub_mapping("sparse_attention_config")
    freq = sparse.get("sparse_attention_freq")
    if freq is None or not sparse.get("use_sparse_attention", True):
        return [False] * n
    if not isinstance(freq, list) or len(freq) != n or not all(isinstance(f, int) for f in freq):
        raise cfg.error(f"sparse_attention_config.sparse_attention_freq must list {n} integers "
                        f"(one per layer), got {freq!r}")
    return [f != 0 for f in freq]


def read_minimax_m3(ctx: SpecContext) -> FamilyLayers:
    """MiniMax-M3: GQA on every layer; sparse layers add a key-only bf16 indexer cache of
    `sparse_index_dim` (transformers: `index_head_dim`, default 128) values.

    No linear-attention state. With any sparse layer the kernels force block size 128.
    """
    cfg = ctx.cfg
    attention = ctx.attention(LayerRole.FULL, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim())
    sparse = minimax_sparse_layers(ctx)
    layers: tuple[LayerSpec | None, ...] = (attention,) * ctx.num_layers
    if not any(sparse):
        return FamilyLayers(layers=layers)
    index_dim = cfg.sub_mapping("sparse_attention_config").get("sparse_index_dim")
    if index_dim is None:
        index_dim = cfg.get_int("index_head_dim", default=128)
    if isinstance(index_dim, bool) or not isinstance(index_dim, int) or index_dim <= 0:
        raise cfg.error(f"sparse_attention_config.sparse_index_dim must be a positive integer, got {index_dim!r}")
    indexer = IndexerSpec(entry_size=index_dim, dtype="bfloat16")
    return FamilyLayers(layers=layers, second_caches=_indexer_slots(sparse, indexer),
                        kernel_block_size=MINIMAX_M3_BLOCK_SIZE, kernel_backend=MINIMAX_M3_BACKEND)


DSV4_BACKEND = "FLASHMLA_SPARSE_DSV4"
DSV4_COMPRESSED_BLOCK_SIZE = 256  # the DSv4 backends' preferred block size (vLLM `get_preferred_block_size`)
DSV4_WINDOW_BLOCK_SIZE = 64  # `DeepseekV4SWACache`
DSV4_FP8_DS_MLA_BYTES = 584  # 448 fp8 NoPE values + 64 bf16 rope values + 8 bytes of UE8M0 scales
DSV4_PAGE_ALIGNMENT = 576  # FlashMLA's packing stride: every fp8_ds_mla-layout page is a multiple of it
_DSV4_STATE_BLOCK = {4: 4, 128: 8}  # compressor state block per ratio (`CompressorStateCache`)


_DSV4_LAYER_TYPES = {"sliding_attention": None, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _dsv4_ratios(ctx: SpecContext) -> list[int]:
    """The compression ratio of each decoder layer (1: window only), from transformers' saved form
    (`layer_types` + `compress_rates`) or the Hub form `compress_ratios` (0 = window only; a trailing
    MTP entry is ignored, as vLLM reads it)."""
    cfg, n = ctx.cfg, ctx.num_layers
    types = cfg.str_list("layer_types")
    if types is not None:
        if len(types) != n or set(types) - set(_DSV4_LAYER_TYPES):
            raise cfg.error(f"field 'layer_types' must list {n} entries of {sorted(_DSV4_LAYER_TYPES)}, got {types!r}")
        rates = cfg.sub_mapping("compress_rates")
        ratios = [1 if _DSV4_LAYER_TYPES[t] is None else rates.get(t, _DSV4_LAYER_TYPES[t]) for t in types]
    else:
        ratios = cfg.raw("compress_ratios")
        if ratios is None:
            raise cfg.error("DeepSeek-V4 needs 'compress_ratios' (one per layer) or 'layer_types'; got neither")
    valid = isinstance(ratios, list) and len(ratios) >= n and all(
        isinstance(r, int) and not isinstance(r, bool) for r in ratios)
    if not valid or set(ratios[:n]) - {0, 1, 4, 128}:
        raise cfg.error(f"field 'compress_ratios' must list at least {n} integers (one per layer), each 0 or 1 "
                        f"(window only), 4 or 128, got {ratios!r}")
    return [max(1, r) for r in ratios[:n]]


def _dsv4_state(role: LatentRole, ratio: int, head_dim: int) -> CompressedMLASpec:
    """The running state of a compressor over `head_dim` values: kv + score, twice with overlap (ratio 4)."""
    coff = 2 if ratio == 4 else 1
    return CompressedMLASpec(role=role, kind=SpecKind.SLIDING_WINDOW, block_size=_DSV4_STATE_BLOCK[ratio],
                             entry_bytes=2 * coff * head_dim * 4, window_tokens=coff * ratio,
                             alignment_bytes=DSV4_PAGE_ALIGNMENT)


def read_deepseek_v4(ctx: SpecContext) -> FamilyLayers:
    """DeepSeek-V4 (Flash, Pro): per layer a sliding-window latent cache; compressed layers add compressed
    latents and a compressor state, ratio-4 layers an indexer (compressed keys + its compressor state).

    Laid out as vLLM 0.32 does on its default FlashMLA backend (the `fp8_ds_mla` layout, also for
    `--kv-cache-dtype auto`), in vLLM's registration order per layer: indexer keys, indexer compressor,
    window, compressed latents, compressor (the window cache sits at the layer's own slot).
    """
    cfg, choice = ctx.cfg, ctx.options.kv_cache_dtype
    if choice is KVCacheDType.NVFP4_DS_MLA:
        raise ConfigError(f"kv_cache_dtype 'nvfp4_ds_mla' is not a DeepSeek-V4 cache format; model_type "
                          f"{cfg.model_type!r} stores fp8_ds_mla; expected 'auto', 'fp8' or 'fp8_ds_mla'")
    head_dim, index_dim = cfg.require_int("head_dim"), cfg.require_int("index_head_dim")
    window = cfg.require_int("sliding_window")
    swa = CompressedMLASpec(role=LatentRole.WINDOW, kind=SpecKind.SLIDING_WINDOW, block_size=DSV4_WINDOW_BLOCK_SIZE,
                            entry_bytes=DSV4_FP8_DS_MLA_BYTES, window_tokens=window,
                            alignment_bytes=DSV4_PAGE_ALIGNMENT)
    extra: list[tuple[int, LayerSpec]] = []
    for layer, ratio in enumerate(_dsv4_ratios(ctx)):
        if ratio == 1:
            continue
        if ratio == 4:
            indexer = CompressedMLASpec(role=LatentRole.INDEXER, kind=SpecKind.FULL,
                                        block_size=DSV4_COMPRESSED_BLOCK_SIZE, tokens_per_state=ratio,
                                        entry_bytes=index_dim + index_dim // _DSA_QUANT_BLOCK * 4,
                                        alignment_bytes=DSV4_PAGE_ALIGNMENT)
            extra += [(layer, indexer), (layer, _dsv4_state(LatentRole.INDEXER_COMPRESSOR, ratio, index_dim))]
        latent = CompressedMLASpec(role=LatentRole.COMPRESSED, kind=SpecKind.FULL,
                                   block_size=DSV4_COMPRESSED_BLOCK_SIZE, tokens_per_state=ratio,
                                   entry_bytes=DSV4_FP8_DS_MLA_BYTES, alignment_bytes=DSV4_PAGE_ALIGNMENT)
        extra += [(layer, latent), (layer, _dsv4_state(LatentRole.COMPRESSOR, ratio, head_dim))]
    return FamilyLayers(layers=(swa,) * ctx.num_layers, second_caches=tuple(extra), kernel_backend=DSV4_BACKEND)
