"""Qwen3.5's Gated DeltaNet projections run as one matmul over the four stacked weights.

Its four outputs equal the four separate products `x @ W.T` (independent F.linear calls): after
loading (which writes into the stack itself, no second copy), after a weight is written in place,
after a parameter is replaced and after a dtype change (the stack is rebuilt then, never stale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.models.gated_deltanet import SplitProjections

CONFIG = {"hidden_size": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 3,
          "linear_value_head_dim": 5, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6}


def _separate(layer: SplitProjections, x: torch.Tensor) -> list[torch.Tensor]:
    return [F.linear(x, m.weight) for m in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a)]


def _check(layer: SplitProjections, x: torch.Tensor) -> None:
    mixed, z, b, a = layer.project(x)
    qkv, z_ref, b_ref, a_ref = _separate(layer, x)
    assert z.shape == (x.shape[0], 4, 5)
    for got, want in ((mixed, qkv), (z.reshape(x.shape[0], -1), z_ref), (b, b_ref), (a, a_ref)):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def test_one_matmul_equals_the_four_projections_after_writes_and_replacements() -> None:
    torch.manual_seed(0)
    layer = SplitProjections(CONFIG, 0)
    x = torch.randn(7, 16)
    _check(layer, x)
    layer.load_state_dict({k: torch.randn_like(v) for k, v in layer.state_dict().items()})
    _check(layer, x)
    assert layer.stacked_weight().data_ptr() == layer.in_proj_qkv.weight.data_ptr()  # loaded in place: no copy
    before = layer.project(x)[1].clone()
    layer.in_proj_a.weight = nn.Parameter(torch.randn_like(layer.in_proj_a.weight))  # a new tensor: rebuilt
    _check(layer, x)
    with torch.no_grad():
        layer.in_proj_z.weight.copy_(torch.randn_like(layer.in_proj_z.weight))  # written in place: rebuilt again
    _check(layer, x)
    assert not torch.allclose(layer.project(x)[1], before)  # the new z weight is used
    layer.to(torch.float64)
    _check(layer, x.double())
