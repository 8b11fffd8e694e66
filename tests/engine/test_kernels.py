"""The native kernels against float64 references: the decode kernel against one written from the
attention rule itself (keys by position, no block tables, no masks) and against the plain-torch
gather path; the RMSNorm kernel against the formula, and the model layer on both paths."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from hybridkv.engine import kernels
from hybridkv.engine.attention import AttentionRule, ScheduledChunk, paged_attention
from hybridkv.engine.kernels import gated_act, kernels_available, rms_norm
from hybridkv.engine.models.layers import RMSNorm
from hybridkv.plan.specs import SpecKind
from tests.engine.attention_helpers import build_group_metadata

RULES = {
    "full": AttentionRule(kind=SpecKind.FULL),
    "sliding": AttentionRule(kind=SpecKind.SLIDING_WINDOW, window_tokens=24),
    "chunked": AttentionRule(kind=SpecKind.CHUNKED_LOCAL, chunk_tokens=32),
}


def test_the_kernel_is_built_where_a_compiler_exists() -> None:
    # CI installs a C compiler (make cc); a missing kernel there is a build failure, not a fallback
    if os.environ.get("HYBRIDKV_KERNELS") == "0":
        pytest.skip("HYBRIDKV_KERNELS=0 turns the kernels off")
    assert kernels_available()


def test_loading_the_kernels_leaves_the_process_floats_alone() -> None:
    # linked with -ffast-math, a shared object turns on flush-to-zero for the process that loads it: the
    # smallest subnormal times 1 would read 0 in every later computation of the user's program
    if not kernels_available():
        pytest.skip("no kernels here")
    code = ("import sys; from hybridkv.engine.kernels import kernels_available; assert kernels_available(); "
            "tiny = sys.float_info.min / 2 ** 52; print(tiny * 1.0 > 0.0, tiny / 2 ** -1 > 0.0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], positions: list[int],
              rule: AttentionRule, scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Row r's query at positions[r] over the keys the rule lets it see, in float64, head by head."""
    heads, kv_heads = q.shape[1], keys[0].shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, pos in enumerate(positions):
        seen = range(rule.first_key(pos), pos + 1)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            k = torch.stack([keys[r][p, kv] for p in seen]).double()  # [n, D]
            v = torch.stack([values[r][p, kv] for p in seen]).double()
            s = k @ q[r, h].double() * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            logits = torch.cat([s, sinks[h : h + 1].double()]) if sinks is not None else s
            p = torch.softmax(logits, dim=0)[: len(seen)]
            out[r, h] = p @ v
    return out


def paged_case(rule: AttentionRule, *, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int):
    """Decode rows of different lengths whose K/V live in scattered blocks of one cache."""
    gen = torch.Generator().manual_seed(seed)
    positions = [0, 5, 23, 24, 47, 70, 96, 130]
    cache = torch.randn(160, 2, block_size, kv_heads, head_dim, generator=gen)
    free = (torch.randperm(159, generator=gen) + 1).tolist()  # block 0 is the null block
    chunks, keys, values = [], [], []
    for pos in positions:
        table = [free.pop() for _ in range(pos // block_size + 1)]
        chunks.append(ScheduledChunk(start_pos=pos, end_pos=pos + 1, block_ids=table))
        slots = [(table[p // block_size], p % block_size) for p in range(pos + 1)]
        keys.append(torch.stack([cache[b, 0, o] for b, o in slots]))
        values.append(torch.stack([cache[b, 1, o] for b, o in slots]))
    meta = build_group_metadata(chunks, rule=rule, block_size=block_size)
    q = torch.randn(len(positions), heads, head_dim, generator=gen)
    return q, cache, meta, keys, values, positions


@pytest.mark.parametrize("rule_name", sorted(RULES))
# head_dim 64: the kernel's vector paths (dot: multiples of 16, accumulate: of 64); 16: vector dot, scalar
# accumulate; 24: scalar both
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(4, 2, 64, 16), (3, 3, 16, 8), (8, 1, 24, 4)])
@pytest.mark.parametrize("extras", ["plain", "softcap", "sinks"])
def test_decode_matches_the_float64_reference_on_both_paths(
    rule_name: str, heads: int, kv_heads: int, head_dim: int, block_size: int, extras: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rule = RULES[rule_name]
    q, cache, meta, keys, values, positions = paged_case(rule, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                         block_size=block_size, seed=heads + block_size)
    softcap = 3.0 if extras == "softcap" else None
    sinks = torch.linspace(-1.0, 2.0, heads) if extras == "sinks" else None
    want = reference(q, keys, values, positions, rule, 0.3, softcap, sinks)
    assert all(call.key_lo is not None for call in meta.calls)  # every call is a decode call
    fast = paged_attention(q, cache, meta, scale=0.3, softcap=softcap, sinks=sinks)
    monkeypatch.setattr(kernels, "kernels_available", lambda: False)
    gathered = paged_attention(q, cache, meta, scale=0.3, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(gathered.double(), want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(fast.double(), want, atol=2e-6, rtol=2e-5)


def test_decode_rows_read_exactly_their_key_slots() -> None:
    # block size 4, W = 6: the decode at position 9 sees keys 4..9 = slots 0..5 of blocks [1, 2, 2] (its
    # table from the block of key 4); the one at position 2 (full table [5]) sees slots 0..2, padded to 3 blocks
    rule = AttentionRule(kind=SpecKind.SLIDING_WINDOW, window_tokens=6)
    chunks = [ScheduledChunk(start_pos=2, end_pos=3, block_ids=[5]),
              ScheduledChunk(start_pos=9, end_pos=10, block_ids=[0, 1, 2])]
    (call,) = build_group_metadata(chunks, rule=rule, block_size=4).calls
    assert call.read_block_ids.tolist() == [[5, 5], [1, 2]]
    assert call.key_lo is not None and call.key_hi is not None
    assert call.key_lo.tolist() == [0, 0] and call.key_hi.tolist() == [3, 6]


@pytest.mark.parametrize("shape", [(7, 256), (3, 5, 64), (4, 60), (1, 3)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_kernel_matches_the_formula(shape: tuple[int, ...], with_weight: bool) -> None:
    # dim 256 / 64: the vector sum of squares; 60 and 3: its scalar tail
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(*shape, generator=gen) * 3.0
    w = torch.randn(shape[-1], generator=gen) if with_weight else None
    xd = x.double()
    want = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6)
    if w is not None:
        want = want * w.double()
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), want, atol=2e-6, rtol=2e-6)


def test_the_norm_layer_gives_the_same_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    norm = RMSNorm(96, eps=1e-5, unit_offset=True)  # Gemma: the weight is an offset from 1
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 96))  # type: ignore[union-attr]
    x = torch.randn(2, 9, 96)
    with torch.inference_mode():
        fast = norm(x)
        monkeypatch.setattr(kernels, "kernels_available", lambda: False)
        plain = norm(x)
    xd = x.double()
    want = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * (1.0 + torch.linspace(-0.5, 0.5, 96).double())
    torch.testing.assert_close(fast.double(), want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(plain.double(), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu"])
def test_gated_act_kernel_matches_the_formula_including_far_tails(act: str) -> None:
    gen = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.randn(4099, generator=gen) * 6.0,  # odd length: the kernel's scalar tail
                      torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 90.0, -90.0, 500.0, -500.0])])
    up = torch.randn(gate.shape, generator=gen)
    g = gate.double()
    if act == "silu":
        want = g / (1.0 + torch.exp(-g)) * up.double()
    else:
        want = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3))) * up.double()
    torch.testing.assert_close(gated_act(gate, up, act).double(), want, atol=1e-6, rtol=1e-5)


def test_gated_act_rejects_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="unsupported activation 'relu'"):
        gated_act(torch.zeros(3), torch.zeros(3), "relu")
    with pytest.raises(ValueError, match=r"gate \(3,\) and up \(4,\)"):
        gated_act(torch.zeros(3), torch.zeros(4), "silu")
