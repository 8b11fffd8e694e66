"""The recurrences of Mamba-style mixers in plain torch (float32): Mamba2 SSD and the Mamba1 scan.

Each comes as `scan` (the tokens of one sequence segment from an initial state, prefill) and
`step` (one token for each of R sequences, decode), the two callables `state_layers.scan_states`
takes; both return (outputs, the state after the last token).

Mamba2 (one scalar decay per head), per head h with state S [P, N]:

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T
    y_t = S_t C_t + D_h * x_t

The scan is the chunked SSD form: tokens are cut into chunks of `SCAN_CHUNK` (the last chunk is
padded with dt = 0 tokens: decay 1, no input, so the state is unchanged); within a chunk the
quadratic form, across chunks the recurrence on chunk states:

    y_l = sum_{s<=l} (C_l . B_s) exp(a_l - a_s) dt_s x_s  +  exp(a_l) C_l S_in     a = cumsum(dt * A)

Mamba1 (one decay per channel and state column): S_t = exp(dt_t A) * S_{t-1} + dt_t x_t B_t,
y_t = S_t C_t + D x_t, a sequential loop over the segment (the SSD form needs a scalar decay).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SCAN_CHUNK = 64  # tokens per SSD chunk: the quadratic intra-chunk part stays cheap


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., l] -> [..., l, l] with out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal."""
    n = a.shape[-1]
    cum = torch.cumsum(a, dim=-1)  # [..., l]
    out = cum[..., :, None] - cum[..., None, :]  # [..., l, l]
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device))
    return out.masked_fill(~keep, -math.inf)


def _per_head(bc: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [T, G, N] -> [T, H, N] float32: head h reads group h // (H / G)."""
    return bc.float().repeat_interleave(heads // bc.shape[1], dim=1)


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 SSD over one segment. x [T, H, P], dt [T, H] (after softplus and clamp), b/c [T, G, N],
    a [H] (negative), d [H], state [H, P, N] -> (y [T, H, P], state after the last token), float32."""
    t, heads, p = x.shape
    chunk = min(SCAN_CHUNK, t)
    back = (-t) % chunk
    x, dt = x.float(), dt.float()

    def chunks(z: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [chunks, chunk, ...], zero tokens at the end
        z = F.pad(z, (0, 0) * (z.dim() - 1) + (0, back))
        return z.view(-1, chunk, *z.shape[1:])

    xdt = chunks(x * dt[..., None])  # [c, l, H, P]
    bc, cc = chunks(_per_head(b, heads)), chunks(_per_head(c, heads))  # [c, l, H, N]
    da = chunks(dt * a.float()[None, :]).permute(0, 2, 1)  # [c, H, l] log decay of each token
    cum = torch.cumsum(da, dim=-1)  # [c, H, l]
    scores = torch.einsum("clhn,cshn->chls", cc, bc) * torch.exp(_segsum(da))  # [c, H, l, s]
    y = torch.einsum("chls,cshp->clhp", scores, xdt)  # [c, l, H, P] within each chunk
    to_end = torch.exp(cum[..., -1:] - cum)  # [c, H, l] decay from each token to its chunk's end
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", bc, to_end, xdt)  # [c, H, P, N]
    chunk_decay = torch.exp(cum[..., -1])  # [c, H]
    entering = [state.float()]  # entering[k]: the state before chunk k
    for k in range(chunk_states.shape[0]):
        entering.append(entering[-1] * chunk_decay[k, :, None, None] + chunk_states[k])
    inner = torch.stack(entering[:-1])  # [c, H, P, N]
    y = y + torch.einsum("clhn,chpn,chl->clhp", cc, inner, torch.exp(cum))  # from the states entering
    y = y.reshape(-1, heads, p)[:t] + d.float()[None, :, None] * x  # [T, H, P]
    return y, entering[-1]


def mamba2_step(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. x [R, H, P], dt [R, H], b/c [R, G, N], state [R, H, P, N] -> (y [R, H, P], new state)."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()
    b, c = _per_head(b, heads), _per_head(c, heads)  # [R, H, N]
    decay = torch.exp(dt * a.float()[None, :])  # [R, H]
    new = state.float() * decay[..., None, None] + (dt[..., None] * x)[..., None] * b[:, :, None, :]  # [R, H, P, N]
    y = torch.einsum("rhpn,rhn->rhp", new, c) + d.float()[None, :, None] * x
    return y, new


def mamba1_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba1 selective scan over one segment: x/dt [T, I] (dt after softplus), b/c [T, N], a [I, N] (negative),
    d [I], state [I, N] -> (y [T, I], state after the last token), float32."""
    x, dt = x.float(), dt.float()
    decay = torch.exp(dt[:, :, None] * a.float()[None])  # [T, I, N]
    inputs = (dt * x)[:, :, None] * b.float()[:, None, :]  # [T, I, N]
    s = state.float()
    states = []
    for i in range(x.shape[0]):
        s = decay[i] * s + inputs[i]  # [I, N]
        states.append(s)
    y = torch.einsum("tin,tn->ti", torch.stack(states), c.float()) + d.float()[None] * x  # [T, I]
    return y, s


def mamba1_step(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x/dt [R, I], b/c [R, N], state [R, I, N] -> (y [R, I], new state)."""
    x, dt = x.float(), dt.float()
    new = torch.exp(dt[..., None] * a.float()[None]) * state.float() + (dt * x)[..., None] * b.float()[:, None, :]
    y = torch.einsum("rin,rn->ri", new, c.float()) + d.float()[None] * x  # [R, I]
    return y, new
