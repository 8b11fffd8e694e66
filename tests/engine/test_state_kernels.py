"""The native state scans (`engine/kernels/state_scan.c`) against float64 recurrences written here
from the layers' formulas, token by token and head by head, on a paged state with padding: decodes
and prefill chunks in one call, checkpoint blocks, untouched blocks left as they were."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from hybridkv.engine import kernels
from hybridkv.engine.state_layers import StateMetadata, StateSequence

pytestmark = pytest.mark.skipif(os.environ.get("HYBRIDKV_KERNELS") == "0",
                                reason="HYBRIDKV_KERNELS=0 turns the kernels off")

BLOCKS = 12


def step_metadata() -> StateMetadata:
    """3 decodes (blocks 4, 9, 1), then a 70-token chunk (running block 6, checkpoints after 16 and 48
    tokens in blocks 2 and 10) and a 5-token chunk (block 7): 78 tokens."""
    chunks = (StateSequence(token_start=3, num_tokens=70, block=6, checkpoints=((16, 2), (48, 10))),
              StateSequence(token_start=73, num_tokens=5, block=7))
    return StateMetadata(num_decodes=3, decode_blocks=torch.tensor([4, 9, 1]), sequences=chunks)


def segments(meta: StateMetadata) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
    """(first token, tokens, running block, [(offset, block)]) of every sequence, decodes first."""
    out = [(i, 1, int(b), []) for i, b in enumerate(meta.decode_blocks.tolist())]
    out += [(s.token_start, s.num_tokens, s.block, list(s.checkpoints)) for s in meta.sequences]
    return out


def run_reference(meta: StateMetadata, before: torch.Tensor, out_shape: tuple[int, ...],
                  token: Callable[[torch.Tensor, int, int], torch.Tensor],
                  ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Every sequence of the step token by token in float64: `token(s, tok, h)` advances head h's state
    s [*S] in place for token `tok` and returns its output. Returns the outputs [T, H, ...] and the
    expected state of every written block (running blocks and checkpoints)."""
    want = torch.empty(out_shape, dtype=torch.float64)
    expected: dict[int, torch.Tensor] = {}
    for first, n, block, points in segments(meta):
        s = before[block].double().clone()
        stops = dict(points)
        for i in range(n):
            for h in range(s.shape[0]):
                want[first + i, h] = token(s[h], first + i, h)
            if i + 1 in stops:
                expected[stops[i + 1]] = s.clone()
        expected[block] = s
    return want, expected


def paged_state(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """[BLOCKS, *shape] float32 view over pages with 24 floats of padding (block stride != packed size)."""
    size = 1
    for s in shape:
        size *= s
    pages = torch.randn(BLOCKS, size + 24, generator=gen) * 0.5
    return pages.as_strided((BLOCKS, *shape), (size + 24, *torch.empty(shape).stride()), 8)


def check_states(state: torch.Tensor, before: torch.Tensor, expected: dict[int, torch.Tensor]) -> None:
    for block in range(BLOCKS):
        want = expected.get(block, before[block].double())
        torch.testing.assert_close(state[block].double(), want, rtol=1e-4, atol=1e-4, msg=f"block {block}")


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))


@pytest.mark.parametrize(("heads", "key_heads", "dv", "dk"), [(8, 4, 32, 32), (2, 2, 24, 40), (3, 1, 5, 7)])
def test_gdn_scan_matches_the_recurrence(heads: int, key_heads: int, dv: int, dk: int) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dk)
    meta = step_metadata()
    t, key_size = 78, key_heads * dk
    wide = torch.randn(t, 2 * key_size + heads * dv + 5, generator=gen)  # a strided conv output, as from a split
    conv = wide[:, : 2 * key_size + heads * dv]
    ab = torch.randn(t, 2 * heads + 3, generator=gen) * 2.0  # raw b and a: strided views
    b, a = ab[:, :heads], ab[:, heads : 2 * heads]
    a_log, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    a_log[0], a[5, 0] = 3.7, 50.0  # g = -e^3.7 * 50 ~ -2000: a decay far below float32's range
    state = paged_state((heads, dv, dk), gen)
    before = state.clone()
    # the layer's formulas (HF's l2norm with eps 1e-6; g and beta from the raw projections), in float64
    cd = conv.double()
    q = cd[:, :key_size].view(t, key_heads, dk)
    k = cd[:, key_size : 2 * key_size].view(t, key_heads, dk)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v = cd[:, 2 * key_size :].view(t, heads, dv)
    g = -a_log.double().exp() * softplus(a.double() + dt_bias.double())
    beta = torch.sigmoid(b.double())
    r = heads // key_heads

    def token(s: torch.Tensor, tok: int, h: int) -> torch.Tensor:
        qh, kh = q[tok, h // r], k[tok, h // r]
        s *= torch.exp(g[tok, h])
        s += beta[tok, h] * torch.outer(v[tok, h] - s @ kh, kh)
        return s @ qh

    want, expected = run_reference(meta, before, (t, heads, dv), token)
    out = kernels.gdn_scan(conv, a, b, a_log=a_log, dt_bias=dt_bias, key_heads=key_heads, state=state,
                           plan=meta.plan, checkpoints=meta.plan_checkpoints, threads=2)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    check_states(state, before, expected)


@pytest.mark.parametrize(("heads", "groups", "p", "n", "limit"),
                         [(8, 1, 32, 64, (0.0, float("inf"))), (4, 2, 16, 24, (0.001, 2.5)), (3, 3, 5, 7, (0.0, 0.5))])
def test_mamba2_scan_matches_the_recurrence(heads: int, groups: int, p: int, n: int,
                                            limit: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + n)
    meta = step_metadata()
    t = 78
    xbc = torch.randn(t, heads * p + 2 * groups * n, generator=gen)  # x, B, C slices of one conv output
    x = xbc[:, : heads * p].view(t, heads, p)
    b = xbc[:, heads * p : heads * p + groups * n].view(t, groups, n)
    c = xbc[:, heads * p + groups * n :].view(t, groups, n)
    zdt = torch.randn(t, heads + 4, generator=gen) * 2.0
    dt = zdt[:, 4:]  # the raw projection, a strided slice
    dt[7, 1] = 3000.0  # decays to 0 (unless the limit clamps the step)
    dt_bias = torch.randn(heads, generator=gen)
    a = -torch.rand(heads, generator=gen) - 0.1
    d = torch.randn(heads, generator=gen)
    state = paged_state((heads, p, n), gen)
    before = state.clone()
    step = softplus(dt.double() + dt_bias.double()).clamp(*limit)
    r = heads // groups

    def token(s: torch.Tensor, tok: int, h: int) -> torch.Tensor:
        bh, ch, xh = b[tok, h // r].double(), c[tok, h // r].double(), x[tok, h].double()
        s.mul_(torch.exp(step[tok, h] * a[h].double())).add_(step[tok, h] * torch.outer(xh, bh))
        return s @ ch + d[h].double() * xh

    want, expected = run_reference(meta, before, (t, heads, p), token)
    out = kernels.mamba2_scan(x, dt, b, c, dt_bias=dt_bias, dt_limit=limit, a=a, d=d, state=state, plan=meta.plan,
                              checkpoints=meta.plan_checkpoints, threads=2)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    check_states(state, before, expected)


@pytest.mark.parametrize(("channels", "n"), [(150, 16), (7, 5)])
def test_mamba1_scan_matches_the_recurrence(channels: int, n: int) -> None:
    gen = torch.Generator().manual_seed(channels + n)
    meta = step_metadata()
    t = 78
    xz = torch.randn(t, 2 * channels, generator=gen)
    x = xz[:, :channels]  # strided, as from the in_proj chunk
    dt = torch.nn.functional.softplus(torch.randn(t, channels, generator=gen))
    dt[6, 2] = 4000.0  # decays to 0
    bc = torch.randn(t, 2 * n, generator=gen)
    b, c = bc[:, :n], bc[:, n:]
    a = -torch.rand(channels, n, generator=gen) - 0.05
    d = torch.randn(channels, generator=gen)
    state = paged_state((channels, n), gen)
    before = state.clone()

    def token(s: torch.Tensor, tok: int, i: int) -> torch.Tensor:  # channel i's state row [N]
        step = dt[tok, i].double()
        s.mul_(torch.exp(step * a[i].double())).add_(step * x[tok, i].double() * b[tok].double())
        return s @ c[tok].double() + d[i].double() * x[tok, i].double()

    want, expected = run_reference(meta, before, (t, channels), token)
    out = kernels.mamba1_scan(x, dt, b, c, a=a, d=d, state=state, plan=meta.plan, checkpoints=meta.plan_checkpoints,
                              threads=2)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    check_states(state, before, expected)


def test_the_scans_reject_layouts_they_cannot_read() -> None:
    meta = step_metadata()
    state = torch.zeros(BLOCKS, 2, 4, 4)
    ab = torch.zeros(78, 2)
    common = dict(a_log=torch.zeros(2), dt_bias=torch.zeros(2), key_heads=1, plan=meta.plan,
                  checkpoints=meta.plan_checkpoints, threads=1)
    with pytest.raises(ValueError, match="does not fit"):  # 1 key head of 4 + 2 heads of 4: 16 channels, not 15
        kernels.gdn_scan(torch.zeros(78, 15), ab, ab, state=state, **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="packed values"):
        kernels.gdn_scan(torch.zeros(16, 78).t(), ab, ab, state=state, **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32"):
        kernels.gdn_scan(torch.zeros(78, 16), ab, ab, state=state.double(), **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be \[78, 2\]"):
        kernels.gdn_scan(torch.zeros(78, 16), torch.zeros(78, 3), ab, state=state, **common)  # type: ignore[arg-type]


@pytest.mark.parametrize(("silu", "with_bias", "kernel"), [(True, True, 4), (False, False, 4), (True, False, 2)])
def test_causal_conv_matches_the_formula_and_stores_the_last_inputs(silu: bool, with_bias: bool, kernel: int) -> None:
    # decodes (1 token: the window is mostly stored rows), a 70-token chunk with checkpoints, a 5-token chunk
    gen = torch.Generator().manual_seed(kernel * 7 + silu)
    meta = step_metadata()
    t, channels = 78, 300  # not a multiple of the kernel's 128-channel work items
    wide = torch.randn(t, channels + 11, generator=gen)
    x = wide[:, 5 : 5 + channels]  # a strided slice, as from a projection's split
    taps = torch.randn(kernel, channels, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    pages = torch.randn(BLOCKS, (kernel - 1) * channels + 16, generator=gen)
    conv_state = pages.as_strided((BLOCKS, kernel - 1, channels), (pages.shape[1], channels, 1), 4)
    before = conv_state.clone()
    want = torch.empty(t, channels, dtype=torch.float64)
    expected: dict[int, torch.Tensor] = {}
    for first, n, block, points in segments(meta):
        window = torch.cat([before[block].double(), x[first : first + n].double()])  # [K-1+n, C]
        for i in range(n):
            y = sum(taps[j].double() * window[i + j] for j in range(kernel))
            y = y + (bias.double() if bias is not None else 0.0)
            want[first + i] = y * torch.sigmoid(y) if silu else y
        for offset, cp in points:
            expected[cp] = window[offset : offset + kernel - 1]
        expected[block] = window[n : n + kernel - 1]
    out = kernels.causal_conv(x, conv_state, taps, bias, meta.plan, meta.plan_checkpoints, silu=silu, threads=2)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for block in range(BLOCKS):
        torch.testing.assert_close(conv_state[block].double(), expected.get(block, before[block].double()),
                                   rtol=0, atol=0, msg=f"block {block}")


@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("per_part_weight", [True, False])
def test_gated_rms_norm_matches_the_formula(gate_first: bool, per_part_weight: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    t, parts, dim = 9, 4, 24
    both = torch.randn(t, 2 * parts * dim + 3, generator=gen) * 3.0
    x, z = both[:, : parts * dim], both[:, parts * dim + 3 :]  # strided, as from one projection
    z[0, :5] = torch.tensor([-500.0, 500.0, -90.0, 90.0, 0.0])  # far tails of the gate
    weight = torch.randn(parts * dim if per_part_weight else dim, generator=gen)
    eps = 1e-6
    xd, gate = x.double().view(t, parts, dim), torch.nn.functional.silu(z.double()).view(t, parts, dim)
    w = weight.double().view(parts, dim) if per_part_weight else weight.double()
    y = xd * gate if gate_first else xd
    normed = y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps) * w
    want = (normed if gate_first else normed * gate).view(t, parts * dim)
    out = kernels.gated_rms_norm(x, z, weight, parts=parts, eps=eps, gate_first=gate_first, threads=2)
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=2e-6)
