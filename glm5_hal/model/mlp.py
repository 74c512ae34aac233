"""Feed-forward blocks: the dense SwiGLU MLP (first layers, shared expert) and the MoE block (router -> moe_gate
-> routed experts through fused_moe, plus the shared expert)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.model.linear import Linear, RoutedExperts
from glm5_hal.model.norms import compute_dtype
from glm5_hal.ops import moe_gate

# One MoE layer's expert choice: (topk_weights [T, k] fp32 (fp64 in a float64 model), topk_ids [T, k] int32).
Routing = tuple[Tensor, Tensor]


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
    discrete choices; fp64 in a float64 model). e_score_correction_bias: [E] buffer of the weight's dtype.
    Call: x [T, D] -> router_logits [T, E] fp32 (fp64 for fp64 x).
    """

    def __init__(self, weight: Tensor, e_score_correction_bias: Tensor) -> None:
        dtype = compute_dtype(weight)
        super().__init__(weight.to(dtype))
        self.register_buffer("e_score_correction_bias", e_score_correction_bias.to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        dtype = compute_dtype(x)
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype))


class MoE(nn.Module):
    """routed(x) + shared_experts(x). x [T, D] -> [T, D] in x's dtype.

    router_logits = gate(x) (fp32) -> moe_gate (sigmoid, bias for selection, group limit, normalise, scale by
    routed_scaling_factor) -> experts(x, topk_weights, topk_ids) (fused_moe); the shared expert is unscaled.
    """

    def __init__(self, cfg: ModelConfig, gate: TopkRouter, experts: RoutedExperts, shared_experts: MLP) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts

    def route(self, x: Tensor) -> Routing:
        """(topk_weights [T, k] fp32, topk_ids [T, k] int32) of the tokens x [T, D]."""
        cfg = self.cfg
        logits = self.gate(x)
        return moe_gate(
            logits,
            self.gate.e_score_correction_bias.to(logits.dtype),
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            norm_topk_prob=cfg.norm_topk_prob,
            scoring=cfg.scoring_func,
        )

    def forward(self, x: Tensor, routing: Routing | None = None) -> tuple[Tensor, Routing]:
        """(output [T, D], the routing used). `routing` forces an expert choice instead of the router's own
        (e.g. a quantized model replaying its floating original's choice, so that quantization error is
        measured on the same experts rather than drowned by the few tokens whose choice flips)."""
        topk_weights, topk_ids = self.route(x) if routing is None else routing
        out = self.experts(x, topk_weights.to(compute_dtype(x)), topk_ids) + self.shared_experts(x)
        return out, (topk_weights, topk_ids)
