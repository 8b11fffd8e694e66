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

import torch
import torch.nn.functional as F

SCAN_CHUNK = 32  # tokens per SSD chunk: the quadratic intra-chunk part stays cheap (1.45x faster than 64 here)
EXP_FLOOR = -80.0  # log decays below this count as e^-80


def _segsum_exp(a: torch.Tensor) -> torch.Tensor:
    """a [..., l] -> [..., l, l] with out[i, j] = exp(a[j+1] + ... + a[i]) for j <= i, 0 above the diagonal.

    Sums below EXP_FLOOR count as EXP_FLOOR (e^-80 ~ 2e-35, as good as 0): torch's exp takes a
    ~15x slower path for arguments far below float32's range (and for -inf)."""
    cum = torch.cumsum(a, dim=-1)  # [..., l]
    out = (cum[..., :, None] - cum[..., None, :]).clamp_(min=EXP_FLOOR, max=0.0).exp_()  # [..., l, l]
    return out.tril_()


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for log decays x <= 0, arguments below EXP_FLOOR raised to it (see `_segsum_exp`)."""
    return x.clamp(min=EXP_FLOOR).exp_()


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 SSD over one segment. x [T, H, P], dt [T, H] (after softplus and clamp), b/c [T, G, N],
    a [H] (negative), d [H], state [H, P, N] -> (y [T, H, P], state after the last token), float32.

    The R = H / G heads of a group share its B and C: C . B is computed once per group, not per head."""
    t, heads, p = x.shape
    groups, n = b.shape[1], b.shape[2]
    r = heads // groups
    chunk = min(SCAN_CHUNK, t)
    back = (-t) % chunk
    x, dt = x.float(), dt.float()

    def chunks(z: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [chunks, chunk, ...], zero tokens at the end
        z = F.pad(z, (0, 0) * (z.dim() - 1) + (0, back))
        return z.view(-1, chunk, *z.shape[1:])

    xdt = chunks(x * dt[..., None])  # [c, l, H, P] token-major
    k = xdt.shape[0]
    bc, cc = chunks(b.float()), chunks(c.float())  # [c, l, G, N]
    da = chunks(dt * a.float()[None, :]).permute(0, 2, 1)  # [c, H, l] log decay of each token
    cum = torch.cumsum(da, dim=-1)  # [c, H, l]
    cb = torch.einsum("clgn,csgn->cgls", cc, bc)  # [c, G, l, s]
    scores = cb[:, :, None] * _segsum_exp(da).view(k, groups, r, chunk, chunk)  # [c, G, R, l, s]
    y = scores @ xdt.view(k, chunk, groups, r, p).permute(0, 2, 3, 1, 4)  # [c, G, R, l, P] within each chunk
    # Across chunks the states are kept per group as S^T [N, R*P] (heads side by side), so the
    # chunk states, the recurrence and the reads from them need no head-major copies:
    to_end = _exp(cum[..., -1:] - cum).transpose(1, 2)  # [c, l, H] decay to the chunk end
    weighted = (xdt * to_end[..., None]).view(k, chunk, groups, r * p).transpose(1, 2)  # [c, G, l, R*P]
    chunk_states = bc.permute(0, 2, 3, 1) @ weighted  # [c, G, N, R*P]
    chunk_decay = _exp(cum[..., -1]).view(k, groups, 1, r, 1)  # [c, G, 1, R, 1]
    entering = torch.empty(k + 1, groups, n, r, p)  # entering[i]: the state before chunk i, as S^T per group
    entering[0] = state.float().reshape(groups, r, p, n).permute(0, 3, 1, 2)
    for i in range(k):
        torch.addcmul(chunk_states[i].view(groups, n, r, p), entering[i], chunk_decay[i], out=entering[i + 1])
    from_state = cc.transpose(1, 2) @ entering[:-1].view(k, groups, n, r * p)  # [c, G, l, R*P]
    # y (token-major) = intra + e^cum (C S_in) + D x
    out = torch.empty(k, chunk, groups, r, p)
    torch.addcmul(y.permute(0, 3, 1, 2, 4), from_state.transpose(1, 2).view(k, chunk, groups, r, p),
                  _exp(cum).transpose(1, 2).view(k, chunk, groups, r, 1), out=out)
    y = out.view(-1, heads, p)[:t].addcmul_(x, d.float()[None, :, None])  # [T, H, P]
    return y, entering[-1].permute(0, 2, 3, 1).reshape(heads, p, n)


def mamba2_step(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. x [R, H, P], dt [R, H], b/c [R, G, N], state [R, H, P, N] (float32: updated in place)
    -> (y [R, H, P], new state).

    The state is viewed as [R, G, H/G, P, N], so each group's B and C broadcast over its heads."""
    rows, heads, p = x.shape
    groups, n = b.shape[1], b.shape[2]
    x, dt = x.float(), dt.float()
    b, c = b.float()[:, :, None, None], c.float()[:, :, None, None]  # [R, G, 1, 1, N]
    new = state.float().mul_(torch.exp(dt * a.float()[None, :])[..., None, None])  # decayed [R, H, P, N]
    grouped = new.view(rows, groups, heads // groups, p, n)  # [R, G, H/G, P, N]
    grouped.addcmul_((dt[..., None] * x).view(*grouped.shape[:-1], 1), b)  # + dt x B^T, in place
    y = torch.linalg.vecdot(grouped, c).view(rows, heads, p).addcmul_(d.float()[None, :, None], x)  # S C + D x
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
