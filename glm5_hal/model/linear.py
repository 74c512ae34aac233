"""The two weight-carrying call sites of the model that quantization may replace: `Linear` and `RoutedExperts`.

Every matrix product of the model with a checkpoint weight goes through one of these two objects (the per-head
kv_b_proj halves excepted, see attention.py), so a quantized model is the same model with some of them swapped
for objects with the same call signature (`CausalLM.replace_module`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm5_hal.ops import fused_moe


class Linear(nn.Module):
    """y = x @ weight^T, the nn.Linear layout, no bias (GLM-5 and DeepSeek-V3.2 have none).

    Attributes:
        weight: [out_features, in_features]. The dense weight, in the model's dtype (the MoE router keeps an
            fp32 copy, see moe.py).

    Call: x [..., in_features] -> [..., out_features] in x's dtype. A replacement (e.g. a W8A8 `QuantLinear`)
    takes and returns the same shapes and dtype, and exposes `in_features` / `out_features`.
    """

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(
                f"weight: expected a 2-D [out_features, in_features] tensor, got shape {tuple(weight.shape)}"
            )
        self.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"


class RoutedExperts(nn.Module):
    """The routed experts of one MoE layer, run through the `fused_moe` op.

    Attributes:
        w13: [E, 2 * I, D]. Per expert, the rows of gate_proj then those of up_proj.
        w2: [E, D, I]. Per expert, down_proj.

    Call: (x [T, D], topk_weights [T, k] fp32, topk_ids [T, k] int32) -> [T, D] in x's dtype, the routing
    weights already applied. A quantized replacement takes and returns the same.
    """

    def __init__(self, w13: Tensor, w2: Tensor) -> None:
        super().__init__()
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2]:
            raise ValueError(
                f"w13, w2: expected [E, 2*I, D] and [E, D, I], got {tuple(w13.shape)} and {tuple(w2.shape)}"
            )
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)

    @classmethod
    def from_expert_weights(cls, gate: list[Tensor], up: list[Tensor], down: list[Tensor]) -> RoutedExperts:
        """From the per-expert checkpoint matrices: gate/up [I, D] and down [D, I], one entry per expert."""
        w13 = torch.stack([torch.cat([g, u], 0) for g, u in zip(gate, up, strict=True)])
        return cls(w13, torch.stack(down))

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return fused_moe(x, topk_weights, topk_ids, self.w13, self.w2)

    def extra_repr(self) -> str:
        num_experts, two_inter, hidden = self.w13.shape
        return f"num_experts={num_experts}, hidden={hidden}, intermediate={two_inter // 2}, dtype={self.w13.dtype}"
