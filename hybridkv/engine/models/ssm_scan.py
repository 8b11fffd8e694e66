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


def _per_head(bc: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [T, G, N] -> [T, H, N] float32: head h reads group h // (H / G)."""
    return bc.float().repeat_interleave(heads // bc.shape[1], dim=1)


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

    xdt = chunks(x * dt[..., None])  # [c, l, H, P]
    k = xdt.shape[0]
    bc, cc = chunks(b.float()), chunks(c.float())  # [c, l, G, N]
    da = chunks(dt * a.float()[None, :]).permute(0, 2, 1)  # [c, H, l] log decay of each token
    cum = torch.cumsum(da, dim=-1)  # [c, H, l]
    cb = torch.einsum("clgn,csgn->cgls", cc, bc)  # [c, G, l, s]
    scores = cb[:, :, None] * _segsum_exp(da).view(k, groups, r, chunk, chunk)  # [c, G, R, l, s]
    xg = xdt.view(k, chunk, groups, r * p).permute(0, 2, 1, 3)  # [c, G, s, R*P]
    xg = xg.reshape(k, groups, chunk, r, p).permute(0, 1, 3, 2, 4)  # [c, G, R, s, P]
    y = scores @ xg  # [c, G, R, l, P] within each chunk
    to_end = _exp(cum[..., -1:] - cum).view(k, groups, r, chunk, 1)  # [c, G, R, l, 1] decay to the chunk end
    weighted = (xg * to_end).permute(0, 1, 3, 2, 4).reshape(k, groups, chunk, r * p)  # [c, G, l, R*P]
    chunk_states = bc.permute(0, 2, 3, 1) @ weighted  # [c, G, N, R*P]
    chunk_states = chunk_states.view(k, groups, n, r, p).permute(0, 1, 3, 4, 2).reshape(k, heads, p, n)  # [c, H, P, N]
    chunk_decay = _exp(cum[..., -1])  # [c, H]
    entering = torch.empty(k + 1, heads, p, n)  # entering[i]: the state before chunk i
    entering[0] = state.float()
    for i in range(k):
        torch.addcmul(chunk_states[i], entering[i], chunk_decay[i, :, None, None], out=entering[i + 1])
    inner = entering[:-1].view(k, groups, r * p, n)  # [c, G, R*P, N]
    from_state = cc.permute(0, 2, 1, 3) @ inner.transpose(-1, -2)  # [c, G, l, R*P]
    from_state = from_state.view(k, groups, chunk, r, p).permute(0, 1, 3, 2, 4)  # [c, G, R, l, P]
    y = y + from_state * _exp(cum).view(k, groups, r, chunk, 1)  # from the states entering
    y = y.view(k, heads, chunk, p).transpose(1, 2).reshape(-1, heads, p)[:t] + d.float()[None, :, None] * x
    return y, entering[-1]


def mamba2_step(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. x [R, H, P], dt [R, H], b/c [R, G, N], state [R, H, P, N] (float32: updated in place)
    -> (y [R, H, P], new state)."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()
    b, c = _per_head(b, heads)[:, :, None], _per_head(c, heads)[:, :, None]  # [R, H, 1, N]
    new = state.float().mul_(torch.exp(dt * a.float()[None, :])[..., None, None])  # decayed [R, H, P, N]
    new.addcmul_((dt[..., None] * x)[..., None], b)  # + dt x B^T, in place
    y = torch.linalg.vecdot(new, c).addcmul_(d.float()[None, :, None], x)  # [R, H, P]: S C + D x
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
