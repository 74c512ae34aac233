"""Mixture of experts: [gate] -> [dispatch] -> [grouped GEMMs] -> [combine], and `fused_moe` of all four.

Routing weights are applied in `moe_combine` and nowhere else; backends whose kernels apply them elsewhere
adapt at their edge.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_hal.checks import (
    ACCUMULATION_DTYPES,
    FLOAT_OP_DTYPES,
    check,
    check_accumulation_tensor,
    check_finite_float,
    check_index_range,
    check_optional_tensor,
    check_permutation,
    check_positive_int,
    check_same_device,
    check_tensor,
    value_checks_enabled,
)
from glm5_hal.ops.common import call_op, custom_op, dispatch

SCORING_FUNCS = ("sigmoid", "softmax")


@custom_op("moe_gate")
def _moe_gate_op(
    router_logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    scoring: str,
) -> tuple[Tensor, Tensor]:
    return dispatch(
        "moe_gate",
        router_logits.device,
        router_logits,
        bias,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=norm_topk_prob,
        scoring=scoring,
    )


@_moe_gate_op.register_fake
def _(router_logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, scoring):
    num_tokens = router_logits.shape[0]
    return (
        router_logits.new_empty(num_tokens, top_k),  # topk_weights: router_logits' dtype
        router_logits.new_empty(num_tokens, top_k, dtype=torch.int32),
    )


def moe_gate(
    router_logits: Tensor,
    bias: Tensor | None,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    scoring: str,
) -> tuple[Tensor, Tensor]:
    """Pick `top_k` routed experts per token (DeepSeek "noaux_tc" routing, optionally group-limited).

    Args:
        router_logits: [T, E], fp32; fp64 in the verification mode (reference backend), where the router
            GEMM ran on fp64 activations. Router gate output.
        bias: [E], router_logits' dtype, or None. e_score_correction_bias; added to the scores for SELECTION only.
        top_k: experts per token (8). n_group, topk_group: with n_group > 1 the E experts form n_group groups,
            a group scores the sum of its two best biased scores, and only the best topk_group groups may be
            picked (DeepSeek-V3.2: 8 / 4; GLM-5: 1 / 1).
        routed_scaling_factor: multiplies the final weights (2.5). The shared expert is never scaled.
        norm_topk_prob: divide the picked scores by their sum (+1e-20) before scaling.
        scoring: "sigmoid" (both models) or "softmax".

    Returns:
        topk_weights: [T, top_k], router_logits' dtype. The UNbiased scores of the picked experts, normalised
            and scaled.
        topk_ids: [T, top_k], int32. The picked experts, best biased score first.

    Reference: ops_reference/moe.py
    """
    sizes: dict[str, int] = {}
    check_tensor("router_logits", router_logits, ["T", "E"], ACCUMULATION_DTYPES, sizes)
    check_optional_tensor("bias", bias, ["E"], (router_logits.dtype,), sizes)
    check_same_device(router_logits=router_logits, bias=bias)
    num_experts = sizes["E"]
    top_k = check_positive_int("top_k", top_k)
    n_group = check_positive_int("n_group", n_group)
    topk_group = check_positive_int("topk_group", topk_group)
    check(scoring in SCORING_FUNCS, ValueError, lambda: f"scoring: expected one of {SCORING_FUNCS}, got {scoring!r}")
    check(
        num_experts % n_group == 0,
        ValueError,
        lambda: f"n_group: expected a divisor of E = {num_experts}, got {n_group}",
    )
    check(topk_group <= n_group, ValueError, lambda: f"topk_group: expected <= n_group = {n_group}, got {topk_group}")
    eligible = topk_group * (num_experts // n_group)
    check(
        top_k <= eligible,
        ValueError,
        lambda: f"top_k: expected <= topk_group * E / n_group = {eligible} selectable experts, got {top_k}",
    )
    check(
        n_group == 1 or num_experts // n_group >= 2,
        ValueError,
        lambda: (
            f"n_group: group scores use each group's top-2 experts, so E / n_group must be >= 2, got "
            f"{num_experts // n_group}"
        ),
    )
    routed_scaling_factor = check_finite_float("routed_scaling_factor", routed_scaling_factor)
    check(
        isinstance(norm_topk_prob, bool), TypeError, lambda: f"norm_topk_prob: expected a bool, got {norm_topk_prob!r}"
    )
    return call_op(
        _moe_gate_op, router_logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, scoring
    )


def _check_topk_ids(topk_ids: Tensor, num_experts: int, sizes: dict[str, int]) -> None:
    check_tensor("topk_ids", topk_ids, ["T", "k"], (torch.int32, torch.int64), sizes)
    check_index_range("topk_ids", topk_ids, 0, num_experts, lambda: f"an expert id of the {num_experts} experts")


def _check_expert_offsets(expert_offsets: Tensor, num_rows: int, sizes: dict[str, int]) -> None:
    sizes["E+1"] = sizes["E"] + 1
    check_tensor("expert_offsets", expert_offsets, ["E+1"], (torch.int64,), sizes)
    if not value_checks_enabled(expert_offsets):
        return
    offsets = expert_offsets.cpu()
    check(
        int(offsets[0]) == 0 and int(offsets[-1]) == num_rows and bool((offsets[1:] >= offsets[:-1]).all()),
        ValueError,
        lambda: (
            f"expert_offsets: expected a non-decreasing prefix sum from 0 to M = {num_rows}, got {offsets.tolist()}"
        ),
    )


@custom_op("moe_dispatch")
def _moe_dispatch_op(x: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    return dispatch("moe_dispatch", x.device, x, topk_ids, num_experts)


@_moe_dispatch_op.register_fake
def _(x, topk_ids, num_experts):
    rows = topk_ids.numel()
    return (
        x.new_empty(rows, x.shape[1]),
        x.new_empty(num_experts + 1, dtype=torch.int64),
        x.new_empty(rows, dtype=torch.int64),
    )


def moe_dispatch(x: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Copy each token once per picked expert, grouping the copies by expert.

    Args:
        x: [T, D], bf16/fp16/fp32, or fp64 (verification mode, reference backend). Token activations.
        topk_ids: [T, k], int32 (or int64). Experts picked per token, from `moe_gate`.
        num_experts: E.

    Returns:
        x_sorted: [T * k, D], x's dtype. Rows grouped by expert ascending, stable in (token, slot) order
            within an expert.
        expert_offsets: [E + 1], int64. Rows of expert e are x_sorted[expert_offsets[e]:expert_offsets[e+1]];
            experts with zero tokens are normal.
        src_index: [T * k], int64. src_index[r] = t * k + j, the assignment row r came from.

    Reference: ops_reference/moe.py
    """
    sizes: dict[str, int] = {}
    check_tensor("x", x, ["T", "D"], FLOAT_OP_DTYPES, sizes)
    num_experts = check_positive_int("num_experts", num_experts)
    _check_topk_ids(topk_ids, num_experts, sizes)
    check_same_device(x=x, topk_ids=topk_ids)
    return call_op(_moe_dispatch_op, x, topk_ids, num_experts)


@custom_op("grouped_matmul")
def _grouped_matmul_op(x_sorted: Tensor, w: Tensor, expert_offsets: Tensor) -> Tensor:
    return dispatch("grouped_matmul", x_sorted.device, x_sorted, w, expert_offsets)


@_grouped_matmul_op.register_fake
def _(x_sorted, w, expert_offsets):
    return x_sorted.new_empty(x_sorted.shape[0], w.shape[1])


def grouped_matmul(x_sorted: Tensor, w: Tensor, expert_offsets: Tensor) -> Tensor:
    """One GEMM per expert over its rows: y[r] = x_sorted[r] @ w[e(r)]^T.

    Args:
        x_sorted: [M, K], bf16/fp16/fp32, or fp64 (verification mode, reference backend). Rows grouped by
            expert (from `moe_dispatch`).
        w: [E, N, K], x_sorted's dtype. One nn.Linear weight per expert.
        expert_offsets: [E + 1], int64. Row range of each expert; must start at 0 and end at M.

    Returns:
        y: [M, N], x_sorted's dtype, accumulated in accumulation_dtype (fp32; fp64 for fp64 x_sorted).

    Reference: ops_reference/moe.py
    """
    sizes: dict[str, int] = {}
    check_tensor("x_sorted", x_sorted, ["M", "K"], FLOAT_OP_DTYPES, sizes)
    check_tensor("w", w, ["E", "N", "K"], (x_sorted.dtype,), sizes)
    _check_expert_offsets(expert_offsets, sizes["M"], sizes)
    check_same_device(x_sorted=x_sorted, w=w, expert_offsets=expert_offsets)
    return call_op(_grouped_matmul_op, x_sorted, w, expert_offsets)


@custom_op("moe_combine")
def _moe_combine_op(y_sorted: Tensor, src_index: Tensor, topk_weights: Tensor) -> Tensor:
    return dispatch("moe_combine", y_sorted.device, y_sorted, src_index, topk_weights)


@_moe_combine_op.register_fake
def _(y_sorted, src_index, topk_weights):
    return y_sorted.new_empty(topk_weights.shape[0], y_sorted.shape[1])


def moe_combine(y_sorted: Tensor, src_index: Tensor, topk_weights: Tensor) -> Tensor:
    """Weighted sum of each token's expert outputs: out[t] = sum_j topk_weights[t, j] * y(t, j).

    Args:
        y_sorted: [T * k, D], bf16/fp16/fp32, or fp64 (verification mode, reference backend). Expert outputs
            in dispatch order.
        src_index: [T * k], int64. From `moe_dispatch`: the assignment t * k + j of each row, a permutation of
            0 .. T * k - 1 (checked, unless value checks are off: then anything else is undefined).
        topk_weights: [T, k], fp32 (fp64 for fp64 y_sorted). From `moe_gate`. Routing weights are applied
            here and nowhere else.

    Returns:
        out: [T, D], y_sorted's dtype, accumulated in accumulation_dtype (fp32; fp64 for fp64 y_sorted).

    Reference: ops_reference/moe.py
    """
    sizes: dict[str, int] = {}
    # y_sorted's dtype decides topk_weights' (accumulation_dtype), and topk_weights' shape decides y_sorted's
    # row count: check y_sorted's dtype alone first so a dtype error names the right argument.
    check_tensor("y_sorted", y_sorted, [None, None], FLOAT_OP_DTYPES)
    check_accumulation_tensor("topk_weights", topk_weights, ["T", "k"], y_sorted.dtype, sizes)
    rows = sizes["T*k"] = sizes["T"] * sizes["k"]
    check_tensor("y_sorted", y_sorted, ["T*k", "D"], FLOAT_OP_DTYPES, sizes)
    check_tensor("src_index", src_index, ["T*k"], (torch.int64,), sizes)
    check_permutation("src_index", src_index, rows)
    check_same_device(y_sorted=y_sorted, src_index=src_index, topk_weights=topk_weights)
    return call_op(_moe_combine_op, y_sorted, src_index, topk_weights)


@custom_op("fused_moe")
def _fused_moe_op(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    return dispatch("fused_moe", x.device, x, topk_weights, topk_ids, w13, w2)


@_fused_moe_op.register_fake
def _(x, topk_weights, topk_ids, w13, w2):
    return x.new_empty(x.shape)


def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The routed experts of one MoE layer: dispatch, SwiGLU expert MLPs, weighted combine.

    Args:
        x: [T, D], bf16/fp16/fp32, or fp64 (verification mode, reference backend). Normed hidden states.
        topk_weights: [T, k], fp32 (fp64 for fp64 x), and topk_ids: [T, k], int32: from `moe_gate`.
        w13: [E, 2 * I, D], x's dtype. Per expert, gate_proj rows then up_proj rows.
        w2: [E, D, I], x's dtype. Per expert, down_proj.

    Returns:
        out: [T, D], x's dtype. sum_j topk_weights[t, j] * down_j(silu(gate_j(x_t)) * up_j(x_t)).

    Reference: ops_reference/moe.py
    """
    sizes: dict[str, int] = {}
    check_tensor("x", x, ["T", "D"], FLOAT_OP_DTYPES, sizes)
    check_tensor("w13", w13, ["E", "two_I", "D"], (x.dtype,), sizes)
    check(sizes["two_I"] % 2 == 0, ValueError, lambda: f"w13: expected 2 * I rows per expert, got {sizes['two_I']}")
    sizes["I"] = sizes["two_I"] // 2
    check_tensor("w2", w2, ["E", "D", "I"], (x.dtype,), sizes)
    check_accumulation_tensor("topk_weights", topk_weights, ["T", "k"], x.dtype, sizes)
    _check_topk_ids(topk_ids, sizes["E"], sizes)
    check_same_device(x=x, topk_weights=topk_weights, topk_ids=topk_ids, w13=w13, w2=w2)
    return call_op(_fused_moe_op, x, topk_weights, topk_ids, w13, w2)
