"""Readers for the state families beyond Mamba hybrids: short convolution, KDA, pure Mamba, OLMo-Hybrid.

Every state here is a `MambaSpec` (one page per request, checkpointed at block boundaries and hit
with the Mamba rules), as vLLM 0.32 keeps them all in its `MambaSpec`. Shapes per TP rank, `s`
speculative tokens (vLLM's `MambaStateShapeCalculator`):

    short conv (LFM2)       conv (K-1+s, C/tp)                           C = conv_dim (hidden_size)
    KDA (Kimi-Linear)       conv (K-1+s, 3*H*D/tp)   recurrent (H/tp, D, D)   float32 unless set
    Mamba1 / Mamba2         as in state_specs (pure stacks: every layer a state)
    Gated DeltaNet          as in state_specs (OLMo-Hybrid, Qwen4-Exp)
    PLE short conv          conv ((K-1)*ngram+s, hidden*hc_count)     Qwen4-Exp's PLE layers, not split by TP
    lightning (MiniMax)     state (H/tp, D, D) only, model dtype
    RG-LRU (RecurrentGemma) conv (K-1+s, W/tp), recurrent (W/tp,) float32

Kimi-Linear's full-attention layers are MLA (one latent per token), as DeepSeek-V3's.
"""

from __future__ import annotations

from hybridkv.plan.config_fields import FamilyLayers, LayerRole, SpecContext, layer_roles
from hybridkv.plan.mla_specs import read_deepseek_mla
from hybridkv.plan.specs import LayerSpec, MambaSpec, MambaType
from hybridkv.plan.state_specs import mamba1_state, mamba2_state, read_gated_deltanet_state

__all__ = [
    "kda_state",
    "read_kimi_linear",
    "read_lfm2",
    "read_mamba",
    "read_mamba2",
    "read_minimax",
    "read_olmo_hybrid",
    "read_qwen4_exp",
    "short_conv_state",
]

_FULL, _STATE, _SLIDING = LayerRole.FULL, LayerRole.STATE, LayerRole.SLIDING


def short_conv_state(ctx: SpecContext, *, channels: int, conv_kernel: int) -> MambaSpec:
    """LFM2's gated short convolution: only a conv state, in the model dtype."""
    columns = conv_kernel - 1 + ctx.options.num_speculative_tokens
    return MambaSpec(mamba_type=MambaType.SHORT_CONV, shapes=((columns, ctx.split("conv_dim", channels)),),
                     dtypes=(ctx.dtype,))


def kda_state(ctx: SpecContext, *, num_heads: int, head_dim: int, conv_kernel: int) -> MambaSpec:
    """Kimi Delta Attention: q, k and v convolutions (one conv state of 3 * H * D channels) and a
    (H, D, D) recurrent state, float32 unless `mamba_ssm_dtype` says otherwise (vLLM's kda_state_dtype)."""
    columns = conv_kernel - 1 + ctx.options.num_speculative_tokens
    heads = ctx.split("linear attention num_heads", num_heads)
    return MambaSpec(mamba_type=MambaType.KDA,
                     shapes=((columns, ctx.split("KDA conv channels", 3 * num_heads * head_dim)),
                             (heads, head_dim, head_dim)),
                     dtypes=(ctx.dtype, ctx.ssm_dtype(default="float32")))


def _stack(roles: list[LayerRole], *, attention: LayerSpec | None, state: LayerSpec) -> FamilyLayers:
    layers = tuple(attention if role is _FULL else state for role in roles)
    return FamilyLayers(layers=layers)


def read_lfm2(ctx: SpecContext) -> FamilyLayers:
    """LFM2 / LFM2-MoE: `layer_types` of "full_attention" / "conv" (or `full_attn_idxs`); conv layers keep a
    short-convolution state of `conv_dim` (default hidden_size) channels and `conv_L_cache` taps. An empty
    `layer_types` (LFM2-MoE configs saved with `[]`) is derived from `full_attn_idxs`, as transformers' LFM2
    config derives a missing one."""
    cfg, n = ctx.cfg, ctx.num_layers
    names = cfg.str_list("layer_types")
    if names:
        if len(names) != n or set(names) - {"full_attention", "conv"}:
            raise cfg.error(f"field 'layer_types' must list {n} entries 'full_attention' or 'conv', got {names!r}")
        roles = [_FULL if name == "full_attention" else _STATE for name in names]
    else:
        full = cfg.int_list("full_attn_idxs")
        if full is None:
            raise cfg.error("needs 'layer_types' (\"full_attention\" / \"conv\" per layer) or 'full_attn_idxs'; "
                            "got neither")
        if any(i >= n for i in full):
            raise cfg.error(f"full_attn_idxs {full} must be below num_hidden_layers = {n}")
        roles = [_FULL if i in full else _STATE for i in range(n)]
    state = short_conv_state(ctx, channels=cfg.get_int("conv_dim", default=cfg.require_int("hidden_size")),
                             conv_kernel=cfg.get_int("conv_L_cache", default=3, minimum=2))
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim()) if _FULL in roles else None
    return _stack(roles, attention=attention, state=state)


def _kimi_roles(ctx: SpecContext) -> list[LayerRole]:
    """`layer_types` (transformers' saved form), else the hub's 1-based `linear_attn_config.kda_layers`."""
    cfg, n = ctx.cfg, ctx.num_layers
    roles = layer_roles(cfg, "layer_types", allowed={_FULL, _STATE}, num_layers=n)
    if roles is not None:
        return roles
    kda = cfg.sub_mapping("linear_attn_config").get("kda_layers")
    if not isinstance(kda, list) or not all(isinstance(i, int) and 1 <= i <= n for i in kda):
        raise cfg.error(f"needs 'layer_types' or linear_attn_config.kda_layers (1-based layer numbers up to {n}); "
                        f"got {kda!r}")
    return [_STATE if i + 1 in kda else _FULL for i in range(n)]


def read_kimi_linear(ctx: SpecContext) -> FamilyLayers:
    """Kimi-Linear: KDA layers with MLA full attention every few layers."""
    cfg = ctx.cfg
    roles = _kimi_roles(ctx)
    hub = cfg.sub_mapping("linear_attn_config")
    num_heads = hub.get("num_heads", cfg.raw("linear_num_heads"))
    head_dim = hub.get("head_dim", cfg.raw("linear_head_dim"))
    kernel = hub.get("short_conv_kernel_size", cfg.raw("linear_conv_kernel_dim"))
    fields = {"linear_num_heads": num_heads, "linear_head_dim": head_dim, "linear_conv_kernel_dim": kernel or 4}
    values = cfg.with_fields(fields)
    state = kda_state(ctx, num_heads=values.require_int("linear_num_heads"),
                      head_dim=values.require_int("linear_head_dim"),
                      conv_kernel=values.get_int("linear_conv_kernel_dim", default=4, minimum=2))
    mla = read_deepseek_mla(ctx).layers[0]
    return _stack(roles, attention=mla, state=state)


def read_mamba(ctx: SpecContext) -> FamilyLayers:
    """Mamba / Falcon-Mamba: every layer a Mamba1 state (`intermediate_size`, `state_size`, `conv_kernel`)."""
    cfg = ctx.cfg
    intermediate = cfg.get_int("intermediate_size", default=cfg.get_int("expand", default=2)
                               * cfg.require_int("hidden_size"))
    state = mamba1_state(ctx, intermediate=intermediate, state_size=cfg.get_int("state_size", default=16),
                         conv_kernel=cfg.get_int("conv_kernel", default=4, minimum=2))
    return FamilyLayers(layers=(state,) * ctx.num_layers)


def read_mamba2(ctx: SpecContext) -> FamilyLayers:
    """Mamba2: every layer a Mamba2 state (`expand * hidden_size` channels, `num_heads` of `head_dim`)."""
    cfg = ctx.cfg
    num_heads, head_dim = cfg.require_int("num_heads"), cfg.require_int("head_dim")
    intermediate = cfg.get_int("expand", default=2) * cfg.require_int("hidden_size")
    if num_heads * head_dim != intermediate:
        raise cfg.error(f"num_heads * head_dim = {num_heads} * {head_dim} must equal expand * hidden_size = "
                        f"{intermediate}")
    state = mamba2_state(ctx, intermediate=intermediate, n_groups=cfg.get_int("n_groups", default=1),
                         num_heads=num_heads, head_dim=head_dim, state_size=cfg.get_int("state_size", default=128),
                         conv_kernel=cfg.get_int("conv_kernel", default=4, minimum=2))
    return FamilyLayers(layers=(state,) * ctx.num_layers)


def read_olmo_hybrid(ctx: SpecContext) -> FamilyLayers:
    """OLMo-Hybrid: Gated DeltaNet layers (`linear_*` fields) and full attention, from `layer_types`."""
    cfg, n = ctx.cfg, ctx.num_layers
    roles = layer_roles(cfg, "layer_types", allowed={_FULL, _STATE}, num_layers=n)
    if roles is None:
        raise cfg.error("required field 'layer_types' is missing; expected \"full_attention\" / \"linear_attention\" "
                        "per layer")
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim())
    return _stack(roles, attention=attention, state=read_gated_deltanet_state(ctx))


_QWEN4_ATTENTION = {"full_attention", "indexed_attention", "qwen_sparse_attention"}


def read_qwen4_exp(ctx: SpecContext) -> FamilyLayers:
    """Qwen4-Exp: Gated DeltaNet layers and gated full attention (as Qwen3-Next), plus a short-convolution state
    on the PLE layers (`ple_layer_ids`, 1-based) of `(ple_conv_kernel_size - 1) * ngram_size` columns over
    `hidden_size * hc_count` channels, never split by TP (vLLM's `get_ple_mamba_state_shape_from_config`).

    With `indexer_n_heads` set the attention layers are QSA sparse attention, whose raw-key ring buffer
    (vLLM's `CircularBufferSpec`) can never serve a prefix hit: not modelled, refused by name.
    """
    cfg, n = ctx.cfg, ctx.num_layers
    if cfg.has("indexer_n_heads"):
        raise cfg.error(f"indexer_n_heads = {cfg.raw('indexer_n_heads')} makes the attention layers QSA sparse "
                        "attention (a raw-key ring buffer that cannot be prefix-cached, compressed keys); its "
                        "layout is not modelled; expected a config without indexer_n_heads (full attention)")
    names = cfg.str_list("layer_types")
    if names is None or len(names) != n or set(names) - _QWEN4_ATTENTION - {"linear_attention"}:
        raise cfg.error(f"field 'layer_types' must list {n} entries 'linear_attention' or one of "
                        f"{sorted(_QWEN4_ATTENTION)}, got {names!r}")
    roles = [_STATE if name == "linear_attention" else _FULL for name in names]
    gdn = read_gated_deltanet_state(ctx)
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=cfg.require_int("head_dim"))
    ple = cfg.int_list("ple_layer_ids") or []
    if any(not 1 <= i <= n for i in ple):
        raise cfg.error(f"ple_layer_ids {ple} must be layer numbers 1..{n}")
    columns = (cfg.get_int("ple_conv_kernel_size", default=4, minimum=2) - 1) * cfg.get_int("ngram_size", default=3)
    channels = cfg.require_int("hidden_size") * cfg.get_int("hc_count", default=4)
    conv = MambaSpec(mamba_type=MambaType.SHORT_CONV,
                     shapes=((columns + ctx.options.num_speculative_tokens, channels),), dtypes=(ctx.dtype,))
    stack = _stack(roles, attention=attention, state=gdn)
    return FamilyLayers(layers=stack.layers, second_caches=tuple((i - 1, conv) for i in sorted(set(ple))))


def read_minimax(ctx: SpecContext) -> FamilyLayers:
    """MiniMax-Text-01 (model_type minimax): lightning (linear) attention layers with softmax attention every
    few layers, from `layer_types` or the hub's `attn_type_list` (0 = lightning, 1 = softmax). A lightning layer
    keeps one (H, D, D) state in the model dtype (vLLM's `linear_attention_state_shape` / `_dtype`)."""
    cfg, n = ctx.cfg, ctx.num_layers
    roles = layer_roles(cfg, "layer_types", allowed={_FULL, _STATE}, num_layers=n)
    if roles is None:
        kinds = cfg.int_list("attn_type_list")
        if kinds is None or len(kinds) != n or set(kinds) - {0, 1}:
            raise cfg.error(f"needs 'layer_types' or 'attn_type_list' ({n} entries, 0 = lightning, 1 = softmax "
                            f"attention); got {kinds!r}")
        roles = [_FULL if kind else _STATE for kind in kinds]
    head_dim = ctx.head_dim()
    heads = ctx.split("num_attention_heads", cfg.require_int("num_attention_heads"))
    state = MambaSpec(mamba_type=MambaType.LIGHTNING, shapes=((heads, head_dim, head_dim),), dtypes=(ctx.dtype,))
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=head_dim)
    return _stack(roles, attention=attention, state=state)


def read_recurrent_gemma(ctx: SpecContext) -> FamilyLayers:
    """RecurrentGemma (Griffin): `block_types` repeated over the layers; "recurrent" layers keep an RG-LRU state
    (conv (conv1d_width - 1, lru_width) in the model dtype, recurrent (lru_width,) float32, as transformers),
    "attention" layers are local attention over the last `attention_window_size` positions."""
    cfg, n = ctx.cfg, ctx.num_layers
    cycle = cfg.str_list("block_types") or ["recurrent", "recurrent", "attention"]
    if not cycle or set(cycle) - {"recurrent", "attention"}:
        raise cfg.error(f"field 'block_types' must list 'recurrent' / 'attention' blocks, got {cycle!r}")
    roles = [_STATE if cycle[i % len(cycle)] == "recurrent" else _SLIDING for i in range(n)]
    width = ctx.split("lru_width", cfg.get_int("lru_width", default=cfg.require_int("hidden_size")))
    columns = cfg.get_int("conv1d_width", default=4, minimum=2) - 1 + ctx.options.num_speculative_tokens
    state = MambaSpec(mamba_type=MambaType.RG_LRU, shapes=((columns, width), (width,)),
                      dtypes=(ctx.dtype, ctx.ssm_dtype(default="float32")))
    window = cfg.get_int("attention_window_size", default=2048)
    attention = ctx.attention(_SLIDING, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim(), window_tokens=window)
    return FamilyLayers(layers=tuple(state if role is _STATE else attention for role in roles))
