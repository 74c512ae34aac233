"""Quantized layers as compositions of the public ops, shared by everything that runs W8A8 / W4A8 weights:
`quantization.QuantLinear` / `QuantRoutedExperts` (glm5-hal's quantized model) and the vLLM plugin's MoE method
(glm5_hal/vllm/moe.py), so that both compute the same thing the same way.

    y = int_linear(x, weight, weight_scale)                    # dynamic_quant -> quant_matmul / w4a8_matmul
    out = routed_expert_mlps(x, topk_weights, topk_ids, E, mlp)  # moe_dispatch -> mlp(e, rows) -> moe_combine
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from glm5_hal.ops import dynamic_quant, moe_combine, moe_dispatch, quant_matmul, w4a8_matmul


def int_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, *, group_size: int | None = None, bias: Tensor | None = None
) -> Tensor:
    """y = x W^T (+ bias) with x quantized per token (dynamic_quant) and W already quantized.

    Args:
        x: [M, K] bf16 / fp16 / fp32.
        weight: [N, K] int8 (W8A8), or [N, K / 2] uint8 (W4A8: int4 codes packed two per byte along K, even k in the
            low nibble).
        weight_scale: [N] fp32 per output channel, or [N, K / group_size] fp32 (W4A8 with groups).
        group_size: W4A8's group along K (None: per channel).
        bias: [N] or None.

    Returns:
        [M, N] in x's dtype.
    """
    x_q, x_scale = dynamic_quant(x)
    if weight.dtype == torch.int8:
        return quant_matmul(x_q, x_scale, weight, weight_scale, bias, out_dtype=x.dtype)
    y = w4a8_matmul(x_q, x_scale, weight, weight_scale, group_size, out_dtype=x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def swiglu(h: Tensor) -> Tensor:
    """silu(gate) * up of h [M, 2 * I] = [gate | up] -> [M, I] (the experts' activation, as fused_moe's)."""
    half = h.shape[-1] // 2
    return torch.nn.functional.silu(h[:, :half]) * h[:, half:]


def routed_expert_mlps(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    num_experts: int,
    expert_mlp: Callable[[int, Tensor], Tensor],
) -> Tensor:
    """A MoE layer's routed experts with a per-expert MLP of the caller's: fused_moe's dispatch and combine around
    `expert_mlp(e, rows [M_e, D]) -> [M_e, D]`, called once per expert that received rows.

    x: [T, D]; topk_weights: [T, k] fp32; topk_ids: [T, k] int32 (moe_gate's). Returns [T, D] in x's dtype, the
    routing weights applied by moe_combine.
    """
    x_sorted, expert_offsets, src_index = moe_dispatch(x, topk_ids, num_experts)
    y_sorted = torch.zeros_like(x_sorted)
    offsets = expert_offsets.tolist()
    for e in range(num_experts):
        rows = slice(offsets[e], offsets[e + 1])
        if rows.start != rows.stop:  # an expert no token chose does no work
            y_sorted[rows] = expert_mlp(e, x_sorted[rows])
    return moe_combine(y_sorted, src_index, topk_weights)
