"""The native state scans (`engine/kernels/state_scan.c`) against float64 recurrences written here
from the layers' formulas, token by token and head by head, on a paged state with padding: decodes
and prefill chunks in one call, checkpoint blocks, untouched blocks left as they were."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize(("heads", "key_heads", "dv", "dk"), [(8, 4, 32, 32), (2, 2, 24, 40), (3, 1, 5, 7)])
def test_gdn_scan_matches_the_recurrence(heads: int, key_heads: int, dv: int, dk: int) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dk)
    meta = step_metadata()
    t = 78
    qk = torch.nn.functional.normalize(torch.randn(t, 2 * key_heads, dk, generator=gen), dim=-1)
    conv = torch.randn(t, 3 * heads * dv, generator=gen)  # v is a strided slice, as in the layer
    v = conv[:, heads * dv : 2 * heads * dv].view(t, heads, dv)
    q, k = qk[:, :key_heads] * dk**-0.5, qk[:, key_heads:]
    q = torch.cat([q, k], dim=1)[:, :key_heads]  # a view with the layer's token stride (2 Hk Dk)
    g = -torch.rand(t, heads, generator=gen) * 3.0
    g[5, 0] = -2000.0  # a decay far below float32's range: e^g is 0
    beta = torch.rand(t, heads, generator=gen)
    state = paged_state((heads, dv, dk), gen)
    before = state.clone()
    expected: dict[int, torch.Tensor] = {}
    want = torch.empty(t, heads, dv, dtype=torch.float64)
    r = heads // key_heads
    for first, n, block, points in segments(meta):
        s = before[block].double().clone()
        stops = dict(points)
        for i in range(n):
            tok = first + i
            for h in range(heads):
                qh, kh = q[tok, h // r].double(), k[tok, h // r].double()
                s[h] *= torch.exp(g[tok, h].double())
                s[h] += beta[tok, h].double() * torch.outer(v[tok, h].double() - s[h] @ kh, kh)
                want[tok, h] = s[h] @ qh
            if i + 1 in stops:
                expected[stops[i + 1]] = s.clone()
        expected[block] = s
    out = kernels.gdn_scan(q, k, v, g, beta, state, meta.plan, meta.plan_checkpoints, threads=2)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    check_states(state, before, expected)


@pytest.mark.parametrize(("heads", "groups", "p", "n"), [(8, 1, 32, 64), (4, 2, 16, 24), (3, 3, 5, 7)])
def test_mamba2_scan_matches_the_recurrence(heads: int, groups: int, p: int, n: int) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + n)
    meta = step_metadata()
    t = 78
    xbc = torch.randn(t, heads * p + 2 * groups * n, generator=gen)  # x, B, C slices of one conv output
    x = xbc[:, : heads * p].view(t, heads, p)
    b = xbc[:, heads * p : heads * p + groups * n].view(t, groups, n)
    c = xbc[:, heads * p + groups * n :].view(t, groups, n)
    dt = torch.rand(t, heads, generator=gen)
    dt[7, 1] = 3000.0  # decays to 0
    a = -torch.rand(heads, generator=gen) - 0.1
    d = torch.randn(heads, generator=gen)
    state = paged_state((heads, p, n), gen)
    before = state.clone()
    expected: dict[int, torch.Tensor] = {}
    want = torch.empty(t, heads, p, dtype=torch.float64)
    r = heads // groups
    for first, count, block, points in segments(meta):
        s = before[block].double().clone()
        stops = dict(points)
        for i in range(count):
            tok = first + i
            for h in range(heads):
                bh, ch = b[tok, h // r].double(), c[tok, h // r].double()
                s[h] = torch.exp(dt[tok, h].double() * a[h].double()) * s[h] + dt[tok, h].double() * torch.outer(
                    x[tok, h].double(), bh)
                want[tok, h] = s[h] @ ch + d[h].double() * x[tok, h].double()
            if i + 1 in stops:
                expected[stops[i + 1]] = s.clone()
        expected[block] = s
    out = kernels.mamba2_scan(x, dt, b, c, a=a, d=d, state=state, plan=meta.plan,
                              checkpoints=meta.plan_checkpoints, threads=2)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    check_states(state, before, expected)


def test_the_scans_reject_layouts_they_cannot_read() -> None:
    meta = step_metadata()
    state = torch.zeros(BLOCKS, 2, 4, 4)
    q = torch.zeros(78, 4, 2)[:, :, :]  # [T, Hk=4, Dk=2] does not fit a state of Dk 4
    v = torch.zeros(78, 2, 4)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.gdn_scan(q, q, v, torch.zeros(78, 2), torch.zeros(78, 2), state, meta.plan, meta.plan_checkpoints,
                         threads=1)
    with pytest.raises(ValueError, match="packed heads"):
        kernels.gdn_scan(torch.zeros(78, 4, 2).transpose(1, 2), torch.zeros(78, 2, 4), v, torch.zeros(78, 2),
                         torch.zeros(78, 2), state, meta.plan, meta.plan_checkpoints, threads=1)
    with pytest.raises(ValueError, match="float32"):
        kernels.gdn_scan(torch.zeros(78, 1, 4), torch.zeros(78, 1, 4), v, torch.zeros(78, 2), torch.zeros(78, 2),
                         state.double(), meta.plan, meta.plan_checkpoints, threads=1)
