"""Gated DeltaNet (the linear-attention layers of Qwen3-Next and Qwen3.5), in plain torch, float32.

Per value head h with key/query k_t, q_t [Dk] (L2-normalised, q scaled by Dk^-0.5), value v_t [Dv],
decay a_t = exp(g_t) and write strength beta_t, the state S [Dv, Dk] evolves as

    S_t = a_t S_{t-1} + beta_t (v_t - a_t S_{t-1} k_t) k_t^T        o_t = S_t q_t

With the native kernels (float32 states) decodes and prefill chunks both run this recurrence
token by token in C (`kernels.gdn_scan`: a head's state stays in L1, q/k norms and gates inside).
The plain-torch path (no compiler, other state dtypes) runs it directly for decodes and in the
chunked form for prefill (32-token chunks, the intra-chunk dependency solved as a unit
lower-triangular system, one state update per chunk).
The layer around it:

    x [T, hidden] -> q, k, v (one conv channel block), z [T, Hv, Dv], b, a [T, Hv]   (projections)
    q, k, v --causal depthwise conv (kernel K) + SiLU--> split; beta = sigmoid(b),
    g = -exp(A_log) * softplus(a + dt_bias); k heads repeated to the Hv value heads
    o [T, Hv, Dv] --RMSNorm(o) * weight * silu(z)--> out_proj -> [T, hidden]

The conv state (K-1 inputs) and S live in the layer's state pages (`engine/state_layers.py`).
Qwen3.5 projects with separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next
with fused `in_proj_qkvz` and `in_proj_ba` grouped per key head (`FusedProjections`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine import kernels
from hybridkv.engine.models.base import ForwardContext, config_value
from hybridkv.engine.models.layers import activation
from hybridkv.engine.state_layers import causal_conv, scan_states
from hybridkv.engine.threads import kernel_threads, one_thread
from hybridkv.errors import ConfigError

CHUNK_TOKENS = 32  # 1.7x faster than 64 on this CPU: the [C, C] products and the solve grow with C
EXP_FLOOR = -80.0  # log decays below this count as e^-80 (see `decay_exp`)


def l2_normalize(x: torch.Tensor, scale: torch.Tensor | float, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D] * rsqrt(sum(x^2) + eps) * scale (HF's l2norm), by one fused rms_norm and one multiply:
    rms_norm(x, eps / D) = x * rsqrt(mean(x^2) + eps / D) = x * rsqrt(sum(x^2) + eps) * sqrt(D)."""
    d = x.shape[-1]
    return F.rms_norm(x, (d,), None, eps / d).mul_(scale * d**-0.5)


def recurrent_step(inputs: Sequence[torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of D sequences: q, k [D, Hk, Dk], v [D, H, Dv], g, beta [D, H]; state [D, H, Dv, Dk],
    updated in place and returned.

    Value head h reads key head h // r (r = H / Hk): the state is viewed as [D, Hk, r, Dv, Dk] so each
    key head's q and k broadcast over its r value heads. The products with k and q are `vecdot`s over
    Dk (a batched matrix-vector product per head is ~4x slower here)."""
    q, k, v, g, beta = inputs
    d, key_heads = k.shape[0], k.shape[1]
    grouped = state.view(d, key_heads, -1, *state.shape[2:])  # [D, Hk, r, Dv, Dk]
    q, k = q[:, :, None, None], k[:, :, None, None]  # [D, Hk, 1, 1, Dk]
    state.mul_(g.exp()[..., None, None])  # decayed: a S
    delta = (v.view(grouped.shape[:-1]) - torch.linalg.vecdot(grouped, k)).mul_(beta.view(*grouped.shape[:3], 1))
    grouped.addcmul_(delta[..., None], k)  # += beta (v - a S k) k^T: [D, Hk, r, Dv, Dk]
    return torch.linalg.vecdot(grouped, q).view(v.shape), state  # [D, H, Dv], [D, H, Dv, Dk]


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in place for log decays x <= 0, arguments below EXP_FLOOR raised to it first.

    torch's exp takes a ~15x slower path for arguments far below float32's range (large decays
    make log decays of -1e3 and less); e^EXP_FLOOR ~ 2e-35 is as good as 0 beside the O(1) terms."""
    return x.clamp_(min=EXP_FLOOR).exp_()


def _into_chunks(tokens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """tokens [n, X, D] -> out [N, X, C, D] (may be a view): token i at chunk i // C, row i % C; rows past n zeroed."""
    n, size = tokens.shape[0], out.shape[2]
    full = n // size
    by_chunk = out.transpose(1, 2)  # [N, C, X, D]
    if full:
        by_chunk[:full].copy_(tokens[: full * size].view(full, size, *tokens.shape[1:]))
    if n % size:
        by_chunk[full, : n % size].copy_(tokens[full * size :])
        by_chunk[full, n % size :].zero_()
    return out


def _decayed_scores(stacked: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, heads: int) -> torch.Tensor:
    """The decayed q.k and beta k.k products of each chunk, per value head.

    stacked [N, Hk, 2C, Dk]: each chunk's queries then keys; decay [N, H, C] (cumulative log decay),
    beta [N, H, C]. Returns [N, H, 2, C, C]: [.., 0, i, j] = q_i.k_j e^(d_i - d_j) for j <= i (0 above),
    [.., 1, i, j] = beta_i k_i.k_j e^(d_i - d_j) for j < i (diagonal and above: any values, never read).
    """
    chunks, key_heads, size = stacked.shape[0], stacked.shape[1], decay.shape[-1]
    r = heads // key_heads
    # e^(d_i - d_j); above the diagonal (d_i - d_j >= 0) clamped to 0: e^0, masked or unread below
    pair = decay_exp((decay[..., :, None] - decay[..., None, :]).clamp_(max=0.0))  # [N, H, C, C]
    scores = stacked @ stacked[:, :, size:].transpose(-1, -2)  # [N, Hk, 2C, C]: q.k (rows :C), k.k (rows C:)
    both = scores.view(chunks, key_heads, 1, 2, size, size) * pair.view(chunks, key_heads, r, 1, size, size)
    both = both.view(chunks, heads, 2, size, size)
    both[:, :, 0].tril_()
    both[:, :, 1].mul_(beta[..., None])
    return both


def chunked_scan(inputs: Sequence[torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of one sequence: q, k [n, Hk, Dk], v [n, H, Dv], g, beta [n, H]; state [H, Dv, Dk].

    Value head h reads key head h // r (r = H / Hk); the q.k and k.k products are computed once per
    key head, by one matmul. Returns outputs [n, H, Dv] and the state after the n tokens. Chunks
    come first in every tensor ([N, H, ...]), so the state recurrence reads each chunk's slice as is.
    """
    q, k, v, g, beta = inputs
    n, heads, key_heads = v.shape[0], v.shape[1], k.shape[1]
    r, size = heads // key_heads, CHUNK_TOKENS
    chunks = -(-n // size)
    dv, dk = v.shape[-1], k.shape[-1]
    # padding tokens are zeros (g = 0, beta = 0, k = 0: they leave the state as it is)
    stacked = q.new_empty(chunks, key_heads, 2 * size, dk)  # [N, Hk, 2C, Dk]: each chunk's queries, then its keys
    q_c, k_c = _into_chunks(q, stacked[:, :, :size]), _into_chunks(k, stacked[:, :, size:])  # [N, Hk, C, Dk]
    v_c = _into_chunks(v, v.new_empty(chunks, heads, size, dv))  # [N, H, C, Dv]
    g_c, beta_c = (_into_chunks(t[..., None], t.new_empty(chunks, heads, size, 1))[..., 0]  # [N, H, C]
                   for t in (g, beta))
    decay = g_c.cumsum(dim=-1)  # [N, H, C] log decay from the chunk start through token i
    both = _decayed_scores(stacked, decay, beta_c, heads)  # [N, H, 2, C, C]
    intra, system = both[:, :, 0], both[:, :, 1]  # [N, H, C, C] each
    grow = decay_exp(decay.clone()).view(chunks, key_heads, r, size, 1)  # [N, Hk, r, C, 1] e^d
    rhs = torch.empty(chunks, heads, size, dv + dk, dtype=v.dtype)  # both right sides of one solve
    torch.mul(v_c, beta_c[..., None], out=rhs[..., :dv])
    torch.mul(k_c[:, :, None], beta_c.view(chunks, key_heads, r, size, 1) * grow,
              out=rhs[..., dv:].view(chunks, key_heads, r, size, dk))
    # system has a unit diagonal (implied by the solve): (I + strictly lower part) X = rhs, solved in place
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True, out=rhs)  # [N, H, C, Dv | Dk]
    last = decay[..., -1:]  # [N, H, 1] log decay over the whole chunk
    to_end = decay_exp(last - decay).view(chunks, key_heads, r, size, 1)  # e^(last - d_i)
    k_to_end = (k_c[:, :, None] * to_end).view(chunks, heads, size, dk).transpose(-1, -2)  # [N, H, Dk, C]
    # Across chunks, with S^T [Dk, Dv] entering chunk c (values, keys: the two parts of `solved`):
    #   S'^T = e^last S^T + k_to_end (values - keys S^T) = (e^last I - k_to_end keys) S^T + k_to_end values
    #        = mix_c S^T + gain_c: one baddbmm per chunk; k_to_end values | keys by one matmul.
    across = k_to_end @ solved  # [N, H, Dk, Dv | Dk]
    mix, gain = across[..., dv:].neg_(), across[..., :dv]  # [N, H, Dk, Dk], [N, H, Dk, Dv]
    mix.diagonal(dim1=-2, dim2=-1).add_(decay_exp(last.clone()))
    entering = torch.empty(chunks + 1, heads, dk, dv, dtype=v.dtype)  # [N+1, H, Dk, Dv]
    entering[0] = state.transpose(-1, -2)
    for c in range(chunks):
        torch.baddbmm(gain[c], mix[c], entering[c], out=entering[c + 1])
    # o = q_grow S_in + intra (values - keys S_in) = intra values + (q_grow - intra keys) S_in
    inner = intra @ solved  # [N, H, C, Dv | Dk]
    reads = (q_c[:, :, None] * grow).view(chunks, heads, size, dk).sub_(inner[..., dv:])  # [N, H, C, Dk]
    out = torch.baddbmm(inner[..., :dv].reshape(-1, size, dv), reads.view(-1, size, dk),
                        entering[:-1].view(-1, dk, dv))  # [N*H, C, Dv]
    out = out.view(chunks, heads, size, dv).transpose(1, 2).reshape(chunks * size, heads, dv)[:n]  # [n, H, Dv]
    return out, entering[-1].transpose(-1, -2).contiguous()


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's Dv channels times `weight`, gated by silu(z) (HF `norm`, weight init 1)."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [T, H, dim] -> [T, H, dim]."""
        if not torch.is_grad_enabled() and kernels.usable(x, gate):
            t, heads, dim = x.shape
            return kernels.gated_rms_norm(x.reshape(t, -1), gate.flatten(1), self.weight, parts=heads, eps=self.eps,
                                          gate_first=False, threads=kernel_threads()).view(t, heads, dim)
        if x.dtype == torch.float32:  # the weight inside the fused norm, the gate applied in place
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps).mul_(F.silu(gate))
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        y = self.weight * y.to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer over the paged state (HF names `conv1d`, `A_log`, `dt_bias`, `norm`, `out_proj`).

    Subclasses add the input projections and implement `project`.
    """

    qk_scale: torch.Tensor  # [2 Hk, 1]: Dk^-0.5 for the query heads, 1 for the key heads

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        self.layer = layer
        hidden = int(config_value(config, "hidden_size", required=True))
        self.k_heads = int(config_value(config, "linear_num_key_heads", required=True))
        self.v_heads = int(config_value(config, "linear_num_value_heads", required=True))
        self.k_dim = int(config_value(config, "linear_key_head_dim", required=True))
        self.v_dim = int(config_value(config, "linear_value_head_dim", required=True))
        if self.v_heads % self.k_heads:
            raise ConfigError(f"linear_num_value_heads = {self.v_heads} must be a multiple of "
                              f"linear_num_key_heads = {self.k_heads}")
        self.key_size, self.value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_channels = conv_channels = 2 * self.key_size + self.value_size
        kernel = int(config_value(config, "linear_conv_kernel_dim", 4))
        self.conv1d = nn.Conv1d(conv_channels, conv_channels, kernel, groups=conv_channels, bias=False)
        self.act = activation(str(config_value(config, "hidden_act", "silu")))
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, eps=float(config_value(config, "rms_norm_eps", 1e-6)))
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)
        qk_scale = torch.tensor([self.k_dim**-0.5] * self.k_heads + [1.0] * self.k_heads)[:, None]
        self.register_buffer("qk_scale", qk_scale, persistent=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> conv input [T, 2*Hk*Dk + Hv*Dv] (q, k, v), z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        mixed, z, b, a = self.project(x)
        with one_thread():  # the conv, the scan and the norm: mid-sized ops a second thread slows down
            o = self.mix(mixed, z, b, a, ctx)  # [T, Hv, Dv]
        return self.out_proj(o.reshape(x.shape[0], self.value_size))  # type: ignore[no-any-return]

    def mix(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
        """The projections' outputs (see `project`) -> the gated, normalised outputs [T, Hv, Dv] (states stored)."""
        t = mixed.shape[0]
        cache, meta = ctx.state_cache(self.layer), ctx.state_metadata(self.layer)
        conv = causal_conv(mixed, cache.conv, meta, self.conv1d.weight[:, 0, :], None, act=self.act)  # [T, C]
        conv = conv.float()
        if kernels.usable(cache.recurrent):  # token by token in C (norms and gates inside)
            o = kernels.gdn_scan(conv, a.float(), b.float(), a_log=self.A_log, dt_bias=self.dt_bias,
                                 key_heads=self.k_heads, state=cache.recurrent, plan=meta.plan,
                                 checkpoints=meta.plan_checkpoints, threads=kernel_threads())
        else:
            # q and k normalised together, q also scaled by Dk^-0.5: [T, 2 Hk, Dk]; the scans share them
            qk = l2_normalize(conv[:, : 2 * self.key_size].view(t, 2 * self.k_heads, self.k_dim), self.qk_scale)
            q, k = qk[:, : self.k_heads], qk[:, self.k_heads :]  # [T, Hk, Dk] each
            v = conv[:, 2 * self.key_size :].reshape(t, self.v_heads, self.v_dim)  # [T, Hv, Dv]
            beta = b.float().sigmoid()  # [T, Hv]
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv]
            o = scan_states(meta, cache.recurrent, (q, k, v, g, beta), step=recurrent_step, scan=chunked_scan)
        return self.norm(o.to(mixed.dtype), z)  # type: ignore[no-any-return]


class SplitProjections(GatedDeltaNet):
    """Qwen3.5: `in_proj_qkv` (q, k, v channel blocks), `in_proj_z`, `in_proj_b`, `in_proj_a`.

    The four weights are row blocks of one stacked tensor [2*Hk*Dk + 2*Hv*Dv + 2*Hv, hidden] (each
    parameter a view of it, so loading writes into it and no copy is kept): the four projections
    run as one matmul. Should a parameter stop being such a view (replaced, or `.to()` another
    dtype), the stack is rebuilt from the four (and rebuilt again whenever one is written to).
    """

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__(config, layer)
        hidden = self.out_proj.out_features
        self.in_proj_qkv = nn.Linear(hidden, 2 * self.key_size + self.value_size, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_size, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.v_heads, bias=False)
        projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        self._stacked = torch.cat([p.weight.detach() for p in projections])  # [out channels, hidden]
        offset = 0
        for p in projections:
            p.weight = nn.Parameter(self._stacked[offset : offset + p.out_features])  # a view: shares the stack
            offset += p.out_features
        self._rebuilt: tuple[tuple[tuple[int, int], ...], torch.Tensor] | None = None

    def stacked_weight(self) -> torch.Tensor:
        """The four projection weights stacked [2*Hk*Dk + 2*Hv*Dv + 2*Hv, hidden] (see the class docstring)."""
        weights = (self.in_proj_qkv.weight, self.in_proj_z.weight, self.in_proj_b.weight, self.in_proj_a.weight)
        stacked, offset = self._stacked, 0
        views = True
        for w in weights:
            views = views and w.dtype == stacked.dtype and w.data_ptr() == stacked[offset].data_ptr()
            offset += w.shape[0]
        if views:
            return stacked
        key = tuple((w.data_ptr(), w._version) for w in weights)
        if self._rebuilt is None or self._rebuilt[0] != key:
            self._rebuilt = key, torch.cat([w.detach() for w in weights])
        return self._rebuilt[1]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        out = F.linear(x, self.stacked_weight())  # [T, conv channels + Hv*Dv + 2 Hv]
        mixed, z, b, a = torch.split(out, [self.conv_channels, self.value_size, self.v_heads, self.v_heads], dim=-1)
        return mixed, z.view(t, self.v_heads, self.v_dim), b, a  # z [T, Hv, Dv]


class FusedProjections(GatedDeltaNet):
    """Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, each grouped per key head.

        in_proj_qkvz -> [T, Hk, (q Dk | k Dk | v r*Dv | z r*Dv)]      in_proj_ba -> [T, Hk, (b r | a r)]
        (r = Hv / Hk value heads per key head)
    """

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__(config, layer)
        hidden = self.out_proj.out_features
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_size + 2 * self.value_size, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t, r = x.shape[0], self.v_heads // self.k_heads
        grouped = self.in_proj_qkvz(x).view(t, self.k_heads, -1)  # [T, Hk, 2*Dk + 2*r*Dv]
        q, k, v, z = grouped.split([self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.k_heads, 2 * r).split([r, r], dim=-1)  # [T, Hk, r] each
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)  # [T, conv channels]
        return (mixed, z.reshape(t, self.v_heads, self.v_dim), b.reshape(t, self.v_heads),
                a.reshape(t, self.v_heads))
