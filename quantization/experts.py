"""QuantRoutedExperts: the routed experts of one MoE layer with W8A8 or W4A8 weights, through the HAL ops.

    moe_dispatch -> per expert: QuantLinear(gate|up) -> silu(gate) * up -> QuantLinear(down) -> moe_combine

A drop-in for glm5_hal.model's `RoutedExperts` (same call: x, topk_weights, topk_ids -> [T, D]). Activations
are quantized per token inside each QuantLinear, so quantizing a whole expert's slice equals quantizing each
token on its own.
"""

from __future__ import annotations

from torch import Tensor, nn

from glm5_hal.quant_layers import routed_expert_mlps, swiglu
from quantization.linear import QuantLinear


class QuantRoutedExperts(nn.Module):
    """Routed experts, one quantized gate|up and one quantized down projection per expert.

    Args:
        gate_up: E QuantLinears [2 * I, D]: the rows of gate_proj, then those of up_proj.
        down: E QuantLinears [D, I].

    Call: (x [T, D], topk_weights [T, k] fp32, topk_ids [T, k] int32) -> [T, D] in x's dtype, the routing weights
    applied by moe_combine.
    """

    def __init__(self, gate_up: list[QuantLinear], down: list[QuantLinear]) -> None:
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(
                f"gate_up, down: expected the same non-zero expert count, got {len(gate_up)} and {len(down)}"
            )
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.intermediate = down[0].in_features

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return routed_expert_mlps(
            x, topk_weights, topk_ids, self.num_experts, lambda e, rows: self.down[e](swiglu(self.gate_up[e](rows)))
        )
