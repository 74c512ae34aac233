"""Feed-forward blocks: the dense SwiGLU MLP (first layers, shared expert) and the MoE block (router -> moe_gate
-> routed experts through fused_moe, plus the shared expert)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.model.linear import Linear, RoutedExperts
from glm5_hal.ops import moe_gate


class MLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); x [T, D] -> [T, D]. Three swappable `Linear`s."""

    def __init__(self, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(gate_proj), Linear(up_proj), Linear(down_proj)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(Linear):
    """The MoE router gate: fp32 logits = fp32(x) @ fp32(weight)^T, and the selection bias.

    weight: [E, D], kept in fp32 (the router is not quantized in the GLM-5 recipe and its logits decide
    discrete choices). e_score_correction_bias: [E] fp32 buffer. Call: x [T, D] -> router_logits [T, E] fp32.
    """

    def __init__(self, weight: Tensor, e_score_correction_bias: Tensor) -> None:
        super().__init__(weight.float())
        self.register_buffer("e_score_correction_bias", e_score_correction_bias.float())

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x.float(), self.weight.float())


class MoE(nn.Module):
    """routed(x) + shared_experts(x). x [T, D] -> [T, D] in x's dtype.

    router_logits = gate(x) (fp32) -> moe_gate (sigmoid, bias for selection, group limit, normalise, scale by
    routed_scaling_factor) -> experts(x, topk_weights, topk_ids) (fused_moe); the shared expert is unscaled.
    """

    def __init__(self, cfg: ModelConfig, gate: TopkRouter, experts: RoutedExperts, shared_experts: MLP) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] int32) of the tokens x [T, D]."""
        cfg = self.cfg
        return moe_gate(
            self.gate(x),
            self.gate.e_score_correction_bias,
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            norm_topk_prob=cfg.norm_topk_prob,
            scoring=cfg.scoring_func,
        )

    def forward(self, x: Tensor) -> Tensor:
        topk_weights, topk_ids = self.route(x)
        return self.experts(x, topk_weights, topk_ids) + self.shared_experts(x)
