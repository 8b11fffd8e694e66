"""The Mamba1 mixer of Jamba (selective scan), HF weight names, float32 math.

    x [T, hidden] --in_proj--> x [T, I] | gate z [T, I]
    x --causal conv1d (kernel K) + act--> x --x_proj--> dt [T, R] | B [T, N] | C [T, N]
    dt, B, C --RMSNorm each (dt_layernorm, b_layernorm, c_layernorm)-->
    dt --dt_proj (no bias), softplus(. + dt_proj.bias)--> dt [T, I]            A = -exp(A_log) [I, N]
    y = selective_scan(x, dt, A, B, C) + D x    (ssm_scan.mamba1_scan / mamba1_step)
    y * silu(z) --out_proj--> [T, hidden]

States live in the pages of the layer's cache slot (`state_layers.py`): the conv state [K-1, I]
and the recurrent state [I, N]. With the native kernels (float32 states) the scan runs token by
token in C (`kernels.mamba1_scan`: channel blocks over both cores), else in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine import kernels
from hybridkv.engine.models.base import ForwardContext
from hybridkv.engine.models.layers import RMSNorm, activation
from hybridkv.engine.models.ssm_scan import mamba1_scan, mamba1_step
from hybridkv.engine.state_layers import causal_conv, scan_states
from hybridkv.engine.threads import kernel_threads, one_thread


@dataclass(frozen=True, slots=True, kw_only=True)
class Mamba1Dims:
    """Sizes and options of one Mamba1 mixer, read from a model's config by its model file."""

    hidden: int
    intermediate: int  # I
    state_size: int  # N
    conv_kernel: int  # K
    dt_rank: int  # R
    eps: float
    act: str = "silu"
    conv_bias: bool = True
    proj_bias: bool = False


class Mamba1Mixer(nn.Module):
    """HF names: in_proj, conv1d, x_proj, dt_proj, A_log [I, N], D, out_proj, dt/b/c_layernorm."""

    def __init__(self, dims: Mamba1Dims) -> None:
        super().__init__()
        self.dims = dims
        i, n = dims.intermediate, dims.state_size
        self.in_proj = nn.Linear(dims.hidden, 2 * i, bias=dims.proj_bias)
        self.conv1d = nn.Conv1d(i, i, dims.conv_kernel, groups=i, bias=dims.conv_bias, padding=dims.conv_kernel - 1)
        self.x_proj = nn.Linear(i, dims.dt_rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(dims.dt_rank, i, bias=True)
        self.A_log = nn.Parameter(torch.zeros(i, n))
        self.D = nn.Parameter(torch.ones(i))
        self.out_proj = nn.Linear(i, dims.hidden, bias=dims.proj_bias)
        self.dt_layernorm = RMSNorm(dims.dt_rank, eps=dims.eps)
        self.b_layernorm = RMSNorm(n, eps=dims.eps)
        self.c_layernorm = RMSNorm(n, eps=dims.eps)
        self.act = activation(dims.act)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, slot: int) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], reading and writing the states of cache slot `slot`."""
        d = self.dims
        cache, meta = ctx.state_cache(slot), ctx.state_metadata(slot)
        xs, z = self.in_proj(x).float().chunk(2, dim=-1)  # [T, I] each
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        with one_thread():  # the conv: mid-sized ops a second thread slows down
            xs = causal_conv(xs, cache.conv, meta, self.conv1d.weight[:, 0].float(), bias, act=self.act)  # [T, I]
        dt, b, c = self.x_proj(xs.to(x.dtype)).float().split([d.dt_rank, d.state_size, d.state_size], dim=-1)
        dt = self.dt_layernorm(dt) @ self.dt_proj.weight.float().t()  # [T, I]
        dt = F.softplus(dt + self.dt_proj.bias.float())
        inputs = (xs, dt, self.b_layernorm(b), self.c_layernorm(c))
        a, skip = -torch.exp(self.A_log.float()), self.D.float()
        if kernels.usable(cache.recurrent):  # token by token in C, both cores
            y = kernels.mamba1_scan(*inputs, a=a, d=skip, state=cache.recurrent, plan=meta.plan,
                                    checkpoints=meta.plan_checkpoints, threads=kernel_threads())
        else:
            with one_thread():  # the sequential scan: one small op per token
                y = scan_states(meta, cache.recurrent, inputs,
                                step=lambda i, s: mamba1_step(*i, a=a, d=skip, state=s),
                                scan=lambda i, s: mamba1_scan(*i, a=a, d=skip, state=s))  # [T, I]
        return self.out_proj((y * F.silu(z)).to(x.dtype))  # type: ignore[no-any-return]
