"""Gemma 3n building blocks: AltUp, the Laurel residual, the sparse gated MLP (HF weight names).

Tokens are flattened ([T, hidden]); the n AltUp copies of the residual stream are stacked in
front ([n, T, hidden]). The math is transformers' `modeling_gemma3n` in inference mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.models.layers import GatedMLP, RMSNorm


def match_magnitude(x: torch.Tensor, target_rms: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] rescaled so each row's RMS is `target_rms` [T, 1] (RMS floored at sqrt(1e-5))."""
    rms = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))  # [T, 1]
    return x * target_rms / rms


class Gemma3nAltUp(nn.Module):
    """Alternating updates: predict the n copies before a layer, correct them with its output.

    Both steps mix the copies with per-token coefficients computed from a router over one copy:
    `predict`: pred_i = x_i + sum_j P[i, j] x_j;  `correct`: out_i = pred_i + (1 + C[i]) (y - pred_active).
    transformers clips the coefficient weights to `altup_coef_clip` only while training (trained
    checkpoints already hold clipped weights), so inference applies them as stored.
    """

    def __init__(self, hidden: int, *, num_inputs: int, active: int, eps: float) -> None:
        super().__init__()
        self.num_inputs = num_inputs
        self.active = active
        self.router_input_scale = hidden**-1.0
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correction_coefs = nn.Linear(num_inputs, num_inputs, bias=False)
        self.prediction_coefs = nn.Linear(num_inputs, num_inputs**2, bias=False)
        self.modality_router = nn.Linear(hidden, num_inputs, bias=False)
        self.router_norm = RMSNorm(hidden, eps=eps)

    def router_modalities(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> tanh router output [T, n]."""
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)  # [T, n]
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, T, hidden] -> predictions [n, T, hidden]."""
        n, t = self.num_inputs, h.shape[1]
        modalities = self.router_modalities(h[self.active])  # [T, n]
        coefs = self.prediction_coefs(modalities).view(t, n, n)  # [T, i (output copy), j (input copy)]
        mixed = torch.matmul(h.permute(1, 2, 0), coefs.transpose(1, 2))  # [T, hidden, j] @ [T, j, i] -> [T, hidden, i]
        return mixed.permute(2, 0, 1) + h  # [n, T, hidden]

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """predictions [n, T, hidden], the layer's output `activated` [T, hidden] -> [n, T, hidden]."""
        modalities = self.router_modalities(activated)  # [T, n]
        innovation = activated - predictions[self.active]  # [T, hidden]
        coefs: torch.Tensor = self.correction_coefs(modalities) + 1.0  # [T, n]
        return innovation[None] * coefs.t()[:, :, None] + predictions  # [n, T, hidden]

    def scale_corrected_output(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] times the learned per-channel `correct_output_scale`."""
        return (x.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(x)


class Gemma3nLaurelBlock(nn.Module):
    """Learned augmented residual: x + norm(right(left(x))), a rank-`laurel_rank` bypass."""

    def __init__(self, hidden: int, *, rank: int, eps: float) -> None:
        super().__init__()
        self.linear_left = nn.Linear(hidden, rank, bias=False)
        self.linear_right = nn.Linear(rank, hidden, bias=False)
        self.post_laurel_norm = RMSNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))  # type: ignore[no-any-return]


class Gemma3nMLP(GatedMLP):
    """The gated MLP down(act(gate(x)) * up(x)); with sparsity s > 0 the gate keeps only values above
    its s-quantile.

    The quantile assumes each token's gate values are Gaussian: cutoff = mean + std * Phi^-1(s),
    and the gate becomes relu(gate - cutoff) (transformers' `_gaussian_topk`).
    """

    def __init__(self, hidden: int, intermediate: int, *, act: str, sparsity: float) -> None:
        super().__init__(hidden, intermediate, act=act)
        self.sparsity = sparsity
        # Phi^-1(s) in float32, as torch.distributions.Normal(0, 1).icdf computes it.
        level = torch.tensor(sparsity, dtype=torch.float32)
        self.std_multiplier = float(torch.erfinv(2 * level - 1) * math.sqrt(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate = self.gate_proj(x)  # [T, intermediate]
        if self.sparsity > 0.0:
            mean = gate.mean(dim=-1, keepdim=True)  # [T, 1]
            std = gate.std(dim=-1, keepdim=True, correction=0)  # [T, 1]
            gate = F.relu(gate - (mean + std * self.std_multiplier))
        return self.down_proj(self.act(gate) * self.up_proj(x))  # type: ignore[no-any-return]
