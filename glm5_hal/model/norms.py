"""The model's normalisations that are not fused into an op: the residual-stream RMSNorms, and the latent
RMSNorms / indexer LayerNorm when the decomposed prologs run (attention.py)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm5_hal.checks import accumulation_dtype


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 activations, fp64 for fp64 ones (the statistics are never less precise than fp32;
    the same rule as the ops' "fp32 by contract" tensors, glm5_hal.checks.accumulation_dtype)."""
    return accumulation_dtype(x.dtype)


class RMSNorm(nn.Module):
    """weight * (x / sqrt(mean(x^2) + eps)): statistics in fp32 (fp64 for fp64 x), then cast to x's dtype
    before the gain (as the checkpoints' reference code and transformers do).
    weight: [D]; x: [..., D] -> [..., D] in x's dtype."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(compute_dtype(x))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm with gain and bias [D] (the indexer's k_norm), computed in fp32 (fp64 for fp64 x), x's dtype out."""

    def __init__(self, weight: Tensor, bias: Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.nn.functional.layer_norm(
            x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps
        )
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
