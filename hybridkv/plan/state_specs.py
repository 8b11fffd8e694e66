"""Readers for the recurrent-state families: Gated DeltaNet, Mamba1 and Mamba2 hybrids.

State shapes follow vLLM (per TP rank; the conv state keeps `conv_kernel - 1` columns plus one
per speculative token, transformers keeps `conv_kernel`):

    Mamba1          conv (K-1+s, I/tp)                          recurrent (I/tp, N)
    Mamba2          conv (K-1+s, (I + 2*G*N)/tp)                recurrent (H/tp, P, N)
    Gated DeltaNet  conv (K-1+s, (2*Hk*Dk + Hv*Dv)/tp)          recurrent (Hv/tp, Dv, Dk)

    K conv kernel, s speculative tokens, I intermediate channels, N state size, G groups
    (raised to tp when tp does not divide it, so each rank holds the groups of its heads),
    H heads of P channels, Hk/Hv key/value heads of Dk/Dv channels.

The conv state is in the model dtype, the recurrent state in `mamba_ssm_dtype` when set.
Falcon-H1 layers and Zamba2 "hybrid" layers hold attention *and* a Mamba2 state: the reader
returns the state as a second cache of that layer (see `ModelSpec.decoder_layer_of`).
"""

from __future__ import annotations

from hybridkv.plan.config_fields import FamilyLayers, LayerRole, SpecContext, layer_roles, pattern_roles
from hybridkv.plan.specs import LayerSpec, MambaSpec, MambaType

_FULL, _STATE, _HYBRID, _NONE = LayerRole.FULL, LayerRole.STATE, LayerRole.HYBRID, LayerRole.NONE
_NEMOTRON_PATTERN: dict[str, LayerRole] = {"M": _STATE, "*": _FULL, "-": _NONE, "E": _NONE}


def _conv_columns(ctx: SpecContext, conv_kernel: int) -> int:
    return conv_kernel - 1 + ctx.options.num_speculative_tokens


def mamba1_state(ctx: SpecContext, *, intermediate: int, state_size: int, conv_kernel: int) -> MambaSpec:
    """Mamba1 state of one layer on one TP rank."""
    channels = ctx.split("mamba intermediate size", intermediate)
    return MambaSpec(
        mamba_type=MambaType.MAMBA1,
        shapes=((_conv_columns(ctx, conv_kernel), channels), (channels, state_size)),
        dtypes=(ctx.dtype, ctx.ssm_dtype()),
    )


def mamba2_state(ctx: SpecContext, *, intermediate: int, n_groups: int, num_heads: int, head_dim: int,
                 state_size: int, conv_kernel: int, ssm_default: str | None = None) -> MambaSpec:
    """Mamba2 state of one layer on one TP rank."""
    tp = ctx.options.tp_size
    if n_groups % tp:
        if n_groups > tp:
            raise ctx.cfg.error(f"mamba n_groups = {n_groups} is neither a divisor nor a multiple of "
                                f"the tensor-parallel size {tp}")
        n_groups = tp  # every rank keeps a copy of the groups its heads read
    conv_dim = ctx.split("mamba intermediate size", intermediate) + 2 * (n_groups // tp) * state_size
    return MambaSpec(
        mamba_type=MambaType.MAMBA2,
        shapes=((_conv_columns(ctx, conv_kernel), conv_dim),
                (ctx.split("mamba num_heads", num_heads), head_dim, state_size)),
        dtypes=(ctx.dtype, ctx.ssm_dtype(default=ssm_default)),
    )


def gated_deltanet_state(ctx: SpecContext, *, k_heads: int, v_heads: int, k_dim: int, v_dim: int,
                         conv_kernel: int) -> MambaSpec:
    """Gated DeltaNet (linear attention) state of one layer on one TP rank."""
    k_heads_per_rank = ctx.split("linear_num_key_heads", k_heads)
    v_heads_per_rank = ctx.split("linear_num_value_heads", v_heads)
    conv_dim = 2 * k_heads_per_rank * k_dim + v_heads_per_rank * v_dim  # q and k, then v channels
    return MambaSpec(
        mamba_type=MambaType.GATED_DELTANET,
        shapes=((_conv_columns(ctx, conv_kernel), conv_dim), (v_heads_per_rank, v_dim, k_dim)),
        dtypes=(ctx.dtype, ctx.ssm_dtype()),
    )


def _assemble(roles: list[LayerRole], *, attention: LayerSpec | None, state: LayerSpec) -> FamilyLayers:
    """Layers of a hybrid stack: FULL -> attention, STATE -> state, HYBRID -> both, NONE -> no cache."""
    layers: list[LayerSpec | None] = []
    second: list[tuple[int, LayerSpec]] = []
    for i, role in enumerate(roles):
        if role in (_FULL, _HYBRID):
            assert attention is not None, "a family with attention layers must pass their spec"
            layers.append(attention)
            if role is _HYBRID:
                second.append((i, state))
        else:
            layers.append(state if role is _STATE else None)
    return FamilyLayers(layers=tuple(layers), second_caches=tuple(second))


def read_gated_deltanet_state(ctx: SpecContext) -> MambaSpec:
    """The Gated DeltaNet state of the `linear_*` fields (Qwen3-Next, Qwen3.5, Qwen4-Exp)."""
    cfg = ctx.cfg
    return gated_deltanet_state(
        ctx, k_heads=cfg.require_int("linear_num_key_heads"), v_heads=cfg.require_int("linear_num_value_heads"),
        k_dim=cfg.require_int("linear_key_head_dim"), v_dim=cfg.require_int("linear_value_head_dim"),
        conv_kernel=cfg.get_int("linear_conv_kernel_dim", default=4, minimum=2),
    )


def read_gated_deltanet_hybrid(ctx: SpecContext) -> FamilyLayers:
    """Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: Gated DeltaNet layers with full attention every k-th layer."""
    cfg, n = ctx.cfg, ctx.num_layers
    roles = layer_roles(cfg, "layer_types", allowed={_FULL, _STATE}, num_layers=n)
    if roles is None:
        period = cfg.get_int("full_attention_interval", default=4)
        roles = pattern_roles(n, period=period, sparse=_FULL, dense=_STATE)
    state = read_gated_deltanet_state(ctx)
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=cfg.require_int("head_dim"))
    return _assemble(roles, attention=attention, state=state)


def read_jamba(ctx: SpecContext) -> FamilyLayers:
    """Jamba: Mamba1 layers with attention where `i % attn_layer_period == attn_layer_offset`."""
    cfg, n = ctx.cfg, ctx.num_layers
    period = cfg.get_int("attn_layer_period", default=8)
    offset = cfg.get_int("attn_layer_offset", default=4, minimum=0)
    if offset >= period:
        raise cfg.error(f"attn_layer_offset = {offset} must be smaller than attn_layer_period = {period}")
    roles = [_FULL if i % period == offset else _STATE for i in range(n)]
    state = mamba1_state(
        ctx, intermediate=cfg.get_int("mamba_expand", default=2) * cfg.require_int("hidden_size"),
        state_size=cfg.require_int("mamba_d_state"), conv_kernel=cfg.get_int("mamba_d_conv", default=4, minimum=2),
    )
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim())
    return _assemble(roles, attention=attention, state=state)


def _prefixed_mamba2(ctx: SpecContext, *, intermediate: int) -> MambaSpec:
    """Mamba2 state from the `mamba_*` fields of Bamba, GraniteMoeHybrid and Falcon-H1."""
    cfg = ctx.cfg
    num_heads = cfg.require_int("mamba_n_heads")
    auto_head_dim = cfg.raw("mamba_d_head") in (None, "auto")
    head_dim = intermediate // num_heads if auto_head_dim else cfg.require_int("mamba_d_head")
    if head_dim * num_heads != intermediate:
        raise cfg.error(f"mamba_n_heads * mamba_d_head = {num_heads} * {head_dim} must equal the mamba "
                        f"intermediate size {intermediate}")
    return mamba2_state(
        ctx, intermediate=intermediate, n_groups=cfg.get_int("mamba_n_groups", default=1), num_heads=num_heads,
        head_dim=head_dim, state_size=cfg.require_int("mamba_d_state"),
        conv_kernel=cfg.get_int("mamba_d_conv", default=4, minimum=2),
    )


def _expanded_hidden(ctx: SpecContext) -> int:
    return ctx.cfg.get_int("mamba_expand", default=2) * ctx.cfg.require_int("hidden_size")


def read_bamba(ctx: SpecContext) -> FamilyLayers:
    """Bamba: Mamba2 layers with attention at `attn_layer_indices`."""
    n = ctx.num_layers
    attn = set(ctx.cfg.int_list("attn_layer_indices") or [])
    if any(i >= n for i in attn):
        raise ctx.cfg.error(f"attn_layer_indices {sorted(attn)} must be below num_hidden_layers = {n}")
    roles = [_FULL if i in attn else _STATE for i in range(n)]
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim())
    return _assemble(roles, attention=attention, state=_prefixed_mamba2(ctx, intermediate=_expanded_hidden(ctx)))


def read_granitemoehybrid(ctx: SpecContext) -> FamilyLayers:
    """Granite 4.0 (GraniteMoeHybrid): `layer_types` of "mamba" / "attention" (all Mamba2 when absent)."""
    n = ctx.num_layers
    roles = layer_roles(ctx.cfg, "layer_types", allowed={_FULL, _STATE}, num_layers=n) or [_STATE] * n
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim())
    return _assemble(roles, attention=attention, state=_prefixed_mamba2(ctx, intermediate=_expanded_hidden(ctx)))


def read_falcon_h1(ctx: SpecContext) -> FamilyLayers:
    """Falcon-H1: every layer runs attention and Mamba2 in parallel, so every layer has both caches."""
    intermediate = ctx.cfg.optional_int("mamba_d_ssm") or _expanded_hidden(ctx)
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim())
    state = _prefixed_mamba2(ctx, intermediate=intermediate)
    return _assemble([_HYBRID] * ctx.num_layers, attention=attention, state=state)


def _first_key(ctx: SpecContext, *names: str) -> str:
    """The first of `names` the config sets (the first name when none is, for the error message)."""
    return next((name for name in names if ctx.cfg.has(name)), names[0])


def _nemotron_roles(ctx: SpecContext) -> list[LayerRole]:
    cfg = ctx.cfg
    for key in ("layers_block_type", "layer_types"):
        roles = layer_roles(cfg, key, allowed={_FULL, _STATE, _NONE}, num_layers=None)
        if roles is not None:
            return roles
    pattern = cfg.raw("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern:
        raise cfg.error("needs 'layers_block_type' or 'hybrid_override_pattern' (e.g. \"M-M*\"); "
                        f"got hybrid_override_pattern = {pattern!r}")
    unknown = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
    if unknown:
        raise cfg.error(f"hybrid_override_pattern {pattern!r} has unknown symbols {unknown}; "
                        f"expected {sorted(_NEMOTRON_PATTERN)}")
    return [_NEMOTRON_PATTERN[symbol] for symbol in pattern]


def read_nemotron_h(ctx: SpecContext) -> FamilyLayers:
    """Nemotron-H: M = Mamba2, * = attention, - = MLP and E = MoE (no cache); state float32 by default."""
    cfg = ctx.cfg
    roles = _nemotron_roles(ctx)
    num_heads, head_dim = cfg.require_int("mamba_num_heads"), cfg.require_int("mamba_head_dim")
    state = mamba2_state(
        ctx, intermediate=num_heads * head_dim, n_groups=cfg.require_int(_first_key(ctx, "n_groups", "mamba_n_groups")),
        num_heads=num_heads, head_dim=head_dim, state_size=cfg.require_int("ssm_state_size"),
        conv_kernel=cfg.get_int(_first_key(ctx, "conv_kernel", "mamba_d_conv"), default=4, minimum=2),
        ssm_default="float32",
    )
    attention = None
    if _FULL in roles:  # older hub files name the attention head size attention_head_dim
        attention_head_dim = cfg.require_int(_first_key(ctx, "head_dim", "attention_head_dim"))
        attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=attention_head_dim)
    return _assemble(roles, attention=attention, state=state)


def read_zamba2(ctx: SpecContext) -> FamilyLayers:
    """Zamba2: Mamba2 layers; "hybrid" layers add a shared-weight attention block with its own KV cache."""
    cfg, n = ctx.cfg, ctx.num_layers
    key = _first_key(ctx, "layers_block_type", "layer_types")
    roles = layer_roles(cfg, key, allowed={_STATE, _HYBRID}, num_layers=n)
    if roles is None:
        raise cfg.error("required field 'layers_block_type' is missing; expected a list of \"mamba\" / \"hybrid\"")
    hidden, num_heads = cfg.require_int("hidden_size"), cfg.require_int("n_mamba_heads")
    intermediate = _expanded_hidden(ctx)
    state = mamba2_state(
        ctx, intermediate=intermediate, n_groups=cfg.get_int("mamba_ngroups", default=1), num_heads=num_heads,
        head_dim=cfg.get_int("mamba_headdim", default=intermediate // num_heads),
        state_size=cfg.require_int("mamba_d_state"), conv_kernel=cfg.get_int("mamba_d_conv", default=4, minimum=2),
    )
    # The attention block reads concat(hidden, embeddings): 2 * hidden_size channels.
    head_dim = cfg.get_int("attention_head_dim", default=2 * hidden // cfg.require_int("num_attention_heads"))
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=head_dim)
    return _assemble(roles, attention=attention, state=state)


def _zamba_roles(ctx: SpecContext) -> list[LayerRole]:
    """`layers_block_type`, else transformers' ZambaConfig rule: mamba, mamba, hybrid, then hybrid where
    `(i - 3) % attn_layer_period == attn_layer_offset`."""
    cfg, n = ctx.cfg, ctx.num_layers
    roles = layer_roles(cfg, "layers_block_type", allowed={_STATE, _HYBRID}, num_layers=n)
    if roles is not None:
        return roles
    period = cfg.get_int("attn_layer_period", default=6)
    offset = cfg.get_int("attn_layer_offset", default=4, minimum=0)
    rest = [_HYBRID if i % period == offset else _STATE for i in range(max(n - 3, 0))]
    return [_STATE, _STATE, _HYBRID, *rest][:n]


def read_zamba(ctx: SpecContext) -> FamilyLayers:
    """Zamba (Zamba1): multi-head Mamba layers; "hybrid" layers add the shared attention block's own KV cache.

    The Mamba state keeps conv (d_conv - 1, I) and recurrent (n_mamba_heads, I / n_mamba_heads, d_state), as
    transformers' cache does (I = mamba_expand * hidden_size); the attention reads 2 * hidden_size channels
    (`attention_head_dim`, default 2 * hidden_size / num_attention_heads)."""
    cfg = ctx.cfg
    hidden, heads = cfg.require_int("hidden_size"), cfg.get_int("n_mamba_heads", default=2)
    intermediate = ctx.split("mamba intermediate size", cfg.get_int("mamba_expand", default=2) * hidden)
    if intermediate % heads:
        raise cfg.error(f"mamba_expand * hidden_size = {intermediate} must be divisible by n_mamba_heads = {heads}")
    state = MambaSpec(
        mamba_type=MambaType.MAMBA1,
        shapes=((_conv_columns(ctx, cfg.get_int("mamba_d_conv", default=4, minimum=2)), intermediate),
                (ctx.split("n_mamba_heads", heads), intermediate // heads, cfg.get_int("mamba_d_state", default=16))),
        dtypes=(ctx.dtype, ctx.ssm_dtype()),
    )
    head_dim = cfg.get_int("attention_head_dim", default=2 * hidden // cfg.require_int("num_attention_heads"))
    attention = ctx.attention(_FULL, kv_heads=ctx.kv_heads(), head_dim=head_dim)
    return _assemble(_zamba_roles(ctx), attention=attention, state=state)
