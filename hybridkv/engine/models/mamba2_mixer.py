"""The Mamba2 mixer (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1), HF weight names, float32 math.

    x [T, hidden] --in_proj--> gate z [T, I] | xBC [T, I + 2GN] | dt [T, H]
    xBC --causal conv1d (kernel K) + act--> x [T, H, P] | B [T, G, N] | C [T, G, N]
    dt  --softplus(dt + dt_bias), clamped to time_step_limit-->        A = -exp(A_log)
    y = SSD(x, dt, A, B, C) + D x                          (ssm_scan.mamba2_scan / mamba2_step)
    y --gated RMSNorm: norm(y * silu(z)) per group of I/G channels (or the gate after the norm)--> out_proj

States live in the pages of the layer's cache slot (`state_layers.py`): the conv state [K-1, I + 2GN]
(the last K-1 conv inputs) and the recurrent state [H, P, N]. Decodes run together through the
one-step recurrence, prefill chunks through the chunked SSD scan, split at the block boundaries
whose checkpoints the step keeps; with the native kernels (float32 states) both run token by token
in C instead (`kernels.mamba2_scan`, the time step computed inside). The dt clamp applies on both
paths (transformers clamps only on its chunked path, so prefill and decode would disagree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine import kernels
from hybridkv.engine.models.base import ForwardContext
from hybridkv.engine.models.layers import activation
from hybridkv.engine.models.ssm_scan import mamba2_scan, mamba2_step
from hybridkv.engine.state_layers import causal_conv, scan_states
from hybridkv.engine.threads import kernel_threads, one_thread


@dataclass(frozen=True, slots=True, kw_only=True)
class Mamba2Dims:
    """Sizes and options of one Mamba2 mixer, read from a model's config by its model file."""

    hidden: int
    intermediate: int  # I = heads * head_dim
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int  # N
    conv_kernel: int  # K
    eps: float
    act: str = "silu"
    conv_bias: bool = True
    proj_bias: bool = False
    out_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    gated_norm: bool = True  # False: y * silu(z) without a norm (Falcon-H1 `mamba_rms_norm` false)
    norm_before_gate: bool = False  # True: norm(y) * silu(z) (Falcon-H1 `mamba_norm_before_gate`)

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of `dim / groups` channels, gated by silu(z) before (default) or after the norm."""

    def __init__(self, dim: int, *, groups: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z [T, dim] -> [T, dim] float32."""
        if not torch.is_grad_enabled() and kernels.usable(y, z):
            return kernels.gated_rms_norm(y, z, self.weight, parts=self.groups, eps=self.eps,
                                          gate_first=not self.norm_before_gate, threads=kernel_threads())
        y, gate = y.float(), F.silu(z.float())
        if not self.norm_before_gate:
            y = gate.mul_(y)  # the gate is a new tensor: y * gate in place
        if self.groups == 1:  # one group: the weight inside the fused norm
            y = F.rms_norm(y, (y.shape[-1],), self.weight.float(), self.eps)
        else:
            g = F.rms_norm(y.view(y.shape[0], self.groups, -1), (y.shape[-1] // self.groups,), None, self.eps)
            y = g.view_as(y).mul_(self.weight.float())  # [T, G, dim/G] normalised, then weighted
        return y.mul_(gate) if self.norm_before_gate else y


class Mamba2Mixer(nn.Module):
    """HF names: in_proj, conv1d (weight [C, 1, K]), dt_bias, A_log, D, norm.weight, out_proj."""

    def __init__(self, dims: Mamba2Dims) -> None:
        super().__init__()
        self.dims = dims
        h = dims.num_heads
        self.in_proj = nn.Linear(dims.hidden, dims.intermediate + dims.conv_dim + h, bias=dims.proj_bias)
        self.conv1d = nn.Conv1d(dims.conv_dim, dims.conv_dim, dims.conv_kernel, groups=dims.conv_dim,
                                bias=dims.conv_bias, padding=dims.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(h))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = GatedRMSNorm(dims.intermediate, groups=dims.n_groups, eps=dims.eps,
                                 norm_before_gate=dims.norm_before_gate) if dims.gated_norm else None
        self.out_proj = nn.Linear(dims.intermediate, dims.hidden, bias=dims.out_bias)
        self.act = activation(dims.act)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> zxbcdt [T, I + conv_dim + H]; models with input multipliers override this."""
        return self.in_proj(x)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, slot: int) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], reading and writing the states of cache slot `slot`."""
        zxbcdt = self.project(x).float()  # [T, I + conv_dim + H]
        with one_thread():  # the conv, the scan and the norm: mid-sized ops a second thread slows down
            gated = self.mix(zxbcdt, ctx, slot)  # [T, I]
        return self.out_proj(gated.to(x.dtype))  # type: ignore[no-any-return]

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt + dt_bias) [T, H] clamped to `time_step_limit` ((0, inf), the default, clamps nothing)."""
        low, high = self.dims.time_step_limit
        dt = F.softplus(dt + self.dt_bias.float())
        return dt if (low, high) == (0.0, float("inf")) else dt.clamp_(low, high)

    def mix(self, zxbcdt: torch.Tensor, ctx: ForwardContext, slot: int) -> torch.Tensor:
        """zxbcdt [T, I + conv_dim + H] -> the gated, normalised SSD outputs [T, I] float32 (states stored)."""
        d, t = self.dims, zxbcdt.shape[0]
        cache, meta = ctx.state_cache(slot), ctx.state_metadata(slot)
        z, xbc, dt = torch.split(zxbcdt, [d.intermediate, d.conv_dim, d.num_heads], dim=-1)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        xbc = causal_conv(xbc, cache.conv, meta, self.conv1d.weight[:, 0].float(), bias, act=self.act)
        gn = d.n_groups * d.state_size
        xs, b, c = torch.split(xbc, [d.intermediate, gn, gn], dim=-1)
        xs = xs.reshape(t, d.num_heads, d.head_dim)  # [T, H, P]
        b, c = b.reshape(t, d.n_groups, d.state_size), c.reshape(t, d.n_groups, d.state_size)  # [T, G, N]
        a, skip = -torch.exp(self.A_log.float()), self.D.float()
        if kernels.usable(cache.recurrent):  # token by token in C (the time step inside)
            y = kernels.mamba2_scan(xs, dt, b, c, dt_bias=self.dt_bias, dt_limit=d.time_step_limit, a=a, d=skip,
                                    state=cache.recurrent, plan=meta.plan, checkpoints=meta.plan_checkpoints,
                                    threads=kernel_threads())
        else:
            y = scan_states(meta, cache.recurrent, (xs, self._time_step(dt), b, c),
                            step=lambda i, s: mamba2_step(*i, a=a, d=skip, state=s),
                            scan=lambda i, s: mamba2_scan(*i, a=a, d=skip, state=s))  # [T, H, P]
        flat = y.reshape(t, d.intermediate)  # [T, I]
        return self.norm(flat, z) if self.norm is not None else flat * F.silu(z)
