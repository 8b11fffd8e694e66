"""The chunked scans (Gated DeltaNet, Mamba2 SSD) against token-by-token float64 recurrences.

Segments of 1, 31, 32 and 77 tokens (inside one chunk, exactly one, several with a partial last
one) from a non-zero state, with mild decays and with decays so large that most pairwise decay
products underflow (per-token log decays down to -200, as random-weight models produce): the
outputs and the final state equal the reference recurrence within float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.models.gated_deltanet import chunked_scan, l2_normalize
from hybridkv.engine.models.ssm_scan import mamba2_scan

LENGTHS = (1, 31, 32, 77)
DECAY_SCALES = (0.5, 200.0)  # largest per-token log decay (negated)
TOLERANCE = 2e-5
# Mamba2 under the large decays: its float32 cumulative log decays (~-1e3 within a chunk) leave
# ~3e-4 in exp(a_l - a_s); the same with and without the exponent floor
MAMBA2_LARGE_DECAY_TOLERANCE = 1e-3


def _gdn_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = a_t S + beta_t (v_t - a_t S k_t) k_t^T, o_t = S_t q_t per value head, float64, one token at a time."""
    r = v.shape[1] // k.shape[1]
    q, k = (t.double().repeat_interleave(r, dim=1) for t in (q, k))  # [n, H, Dk]
    s = state.double().clone()  # [H, Dv, Dk]
    outs = []
    for t in range(v.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        delta = (v[t].double() - torch.einsum("hvk,hk->hv", s, k[t])) * beta[t].double()[:, None]
        s = s + delta[:, :, None] * k[t][:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", s, q[t]))
    return torch.stack(outs), s


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("decay", DECAY_SCALES)
def test_gated_deltanet_chunked_scan_matches_the_recurrence(n: int, decay: float) -> None:
    gen = torch.Generator().manual_seed(n)
    key_heads, heads, dk, dv = 2, 4, 8, 6
    q = l2_normalize(torch.randn(n, key_heads, dk, generator=gen), dk**-0.5)
    k = l2_normalize(torch.randn(n, key_heads, dk, generator=gen), 1.0)
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, generator=gen) ** 2 * decay  # some tokens decay little, some a lot
    beta = torch.rand(n, heads, generator=gen)
    state = torch.randn(heads, dv, dk, generator=gen)
    out, final = chunked_scan((q, k, v, g, beta), state)
    ref_out, ref_final = _gdn_reference(q, k, v, g, beta, state)
    assert out.shape == (n, heads, dv) and final.shape == (heads, dv, dk)
    assert torch.allclose(out.double(), ref_out, atol=TOLERANCE), (out.double() - ref_out).abs().max()
    assert torch.allclose(final.double(), ref_final, atol=TOLERANCE), (final.double() - ref_final).abs().max()


def _mamba2_reference(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a: torch.Tensor,
                      d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = exp(dt_t a) S + dt_t x_t B_t^T, y_t = S_t C_t + D x_t per head, float64, one token at a time."""
    r = x.shape[1] // b.shape[1]
    b, c = (t.double().repeat_interleave(r, dim=1) for t in (b, c))  # [n, H, N]
    s = state.double().clone()  # [H, P, N]
    outs = []
    for t in range(x.shape[0]):
        s = s * (dt[t].double() * a.double()).exp()[:, None, None]
        s = s + (dt[t].double()[:, None] * x[t].double())[:, :, None] * b[t][:, None, :]
        outs.append(torch.einsum("hpn,hn->hp", s, c[t]) + d.double()[:, None] * x[t].double())
    return torch.stack(outs), s


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("decay", DECAY_SCALES)
def test_mamba2_chunked_scan_matches_the_recurrence(n: int, decay: float) -> None:
    gen = torch.Generator().manual_seed(100 + n)
    heads, groups, p, state_size = 4, 2, 6, 5
    x = torch.randn(n, heads, p, generator=gen)
    dt = torch.rand(n, heads, generator=gen) ** 2  # dt * a down to -decay
    b = torch.randn(n, groups, state_size, generator=gen)
    c = torch.randn(n, groups, state_size, generator=gen)
    a, skip = -torch.linspace(0.25, 1.0, heads) * decay, torch.randn(heads, generator=gen)
    state = torch.randn(heads, p, state_size, generator=gen)
    y, final = mamba2_scan(x, dt, b, c, a=a, d=skip, state=state)
    ref_y, ref_final = _mamba2_reference(x, dt, b, c, a, skip, state)
    tolerance = TOLERANCE if decay < 1 else MAMBA2_LARGE_DECAY_TOLERANCE
    assert y.shape == (n, heads, p) and final.shape == (heads, p, state_size)
    assert torch.allclose(y.double(), ref_y, atol=tolerance), (y.double() - ref_y).abs().max()
    assert torch.allclose(final.double(), ref_final, atol=tolerance), (final.double() - ref_final).abs().max()
