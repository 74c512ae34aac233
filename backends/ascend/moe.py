"""MoE on Ascend: npu_moe_gating_top_k -> npu_moe_init_routing_v2 -> npu_grouped_matmul -> npu_moe_token_unpermute.

moe_gate:        npu_moe_gating_top_k(norm_type 1 sigmoid | 0 softmax, group_select_mode 1 = top-2 sum,
                 k_group = topk_group, group_count = n_group, renorm 0). The kernel always normalises
                 sigmoid weights and never softmax ones (renorm 0 is the only value torch_npu 2.14 takes), so
                 sigmoid without norm_topk_prob and softmax with it run the portable path.
moe_dispatch:    npu_moe_init_routing_v2(row_idx_type 1: expanded_row_idx[r] = assignment of row r, which is
                 the contract's src_index; expert_tokens_num_type 1: per-expert counts -> expert_offsets)
grouped_matmul:  npu_grouped_matmul(x=[x_sorted], weight=[w^T as a transposed view], group_type 0 (m axis),
                 group_list = expert_offsets[1:], group_list_type 0, split_item 2)
moe_combine:     npu_moe_token_unpermute(sorted_indices = inverse of src_index, probs = topk_weights): the only
                 place routing weights are applied, as the contract wants
fused_moe:       the four kernels above with npu_swiglu between the GEMMs; dispatch asks for row_idx_type 0,
                 whose index is exactly what npu_moe_token_unpermute takes. The kernels keep bf16 / fp16
                 intermediates, so fp16 and bf16 with fewer than 16 outputs per token run the portable path
                 (glm5_hal.vendor_precision).
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend.layouts import group_list, invert_permutation, offsets_from_counts
from backends.ascend.runtime import npu, portable
from glm5_hal.checks import value_checks_enabled
from glm5_hal.vendor_precision import fused_moe_chain_unsupported

MAX_EXPERTS_GATING = 2048  # npu_moe_gating_top_k: E <= 2048
MAX_EXPERTS_ROUTING = 10240  # npu_moe_init_routing_v2: expert_num in (0, 10240]
MAX_GROUPS = 1024  # npu_grouped_matmul: group_list holds at most 1024 groups
INNER_LIMIT = 65536  # npu_grouped_matmul: K and N below 65536
MAX_UNPERMUTE_TOPK = 512  # npu_moe_token_unpermute: topK <= 512


def moe_gate_unsupported(num_experts: int, n_group: int, scoring: str, norm_topk_prob: bool) -> str | None:
    """Why npu_moe_gating_top_k cannot express this routing, or None if it can."""
    if (scoring == "sigmoid") != norm_topk_prob:
        return "npu_moe_gating_top_k normalises sigmoid weights and (renorm 0) never softmax ones"
    if num_experts > MAX_EXPERTS_GATING:
        return f"npu_moe_gating_top_k takes at most {MAX_EXPERTS_GATING} experts"
    per_group = num_experts // n_group
    if per_group <= 2 or -(-per_group // 32) * 32 * n_group > MAX_EXPERTS_GATING:
        return "npu_moe_gating_top_k takes groups of more than 2 experts, 32-aligned groups totalling <= 2048"
    return None


def _holds_nan(router_logits: Tensor, bias: Tensor | None) -> bool:
    """Whether a NaN reaches the routing scores, asked only while value checks run (it reads a value back)."""
    if not value_checks_enabled(router_logits):
        return False
    return bool(torch.isnan(router_logits).any()) or (bias is not None and bool(torch.isnan(bias).any()))


def moe_gate(router_logits, bias, *, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, scoring):
    """glm5_hal.moe_gate on torch_npu: router_logits [T, E] fp32, bias [E] fp32 or None
    -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32)."""
    unsupported = moe_gate_unsupported(router_logits.shape[1], n_group, scoring, norm_topk_prob)
    if unsupported is None and _holds_nan(router_logits, bias):
        # The contract ranks NaN first (docs/ops.md "NaN"); how the kernel ranks it is not documented.
        unsupported = "a NaN router logit or bias: npu_moe_gating_top_k does not document how it ranks NaN"
    if unsupported is not None:
        return portable("moe_gate", unsupported)(
            router_logits,
            bias,
            top_k=top_k,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            norm_topk_prob=norm_topk_prob,
            scoring=scoring,
        )
    weights, ids, _ = npu().npu_moe_gating_top_k(
        router_logits,
        top_k,
        bias=bias,
        k_group=topk_group,
        group_count=n_group,
        group_select_mode=1,  # a group scores the sum of its two best biased scores
        renorm=0,
        norm_type=1 if scoring == "sigmoid" else 0,
        routed_scaling_factor=routed_scaling_factor,
        eps=1e-20,
    )
    return weights.to(torch.float32), ids.to(torch.int32)


def _routing(x: Tensor, topk_ids: Tensor, num_experts: int, row_idx_type: int) -> tuple[Tensor, Tensor, Tensor]:
    """npu_moe_init_routing_v2 -> (x_sorted [T*k, D], row index [T*k] int32, expert_offsets [E+1] int64)."""
    x_sorted, row_idx, counts, _ = npu().npu_moe_init_routing_v2(
        x.contiguous(),
        topk_ids.to(torch.int32).contiguous(),
        expert_num=num_experts,
        expert_tokens_num_type=1,  # per-expert counts (cumsum is not among the values torch_npu 2.14 takes)
        expert_tokens_num_flag=True,
        quant_mode=-1,
        active_expert_range=[0, num_experts],
        row_idx_type=row_idx_type,
    )
    return x_sorted, row_idx, offsets_from_counts(counts)


def _routing_unsupported(x: Tensor, topk_ids: Tensor, num_experts: int) -> str | None:
    if num_experts > MAX_EXPERTS_ROUTING:
        return f"npu_moe_init_routing_v2 takes at most {MAX_EXPERTS_ROUTING} experts"
    if topk_ids.numel() == 0 or x.shape[1] == 0:
        return "no assignments"
    return None


def moe_dispatch(x, topk_ids, num_experts):
    """glm5_hal.moe_dispatch on torch_npu: x [T, D], topk_ids [T, k]
    -> (x_sorted [T*k, D], expert_offsets [E+1] int64, src_index [T*k] int64)."""
    unsupported = _routing_unsupported(x, topk_ids, num_experts)
    if unsupported is not None:
        return portable("moe_dispatch", unsupported)(x, topk_ids, num_experts)
    x_sorted, src_index, offsets = _routing(x, topk_ids, num_experts, row_idx_type=1)
    return x_sorted, offsets, src_index.to(torch.int64)


def _gemm_unsupported(num_rows: int, w: Tensor) -> str | None:
    """Why npu_grouped_matmul cannot multiply `num_rows` rows by w [E, N, K], or None if it can."""
    experts, n, k = w.shape
    if experts > MAX_GROUPS:
        return f"npu_grouped_matmul takes at most {MAX_GROUPS} groups"
    if k >= INNER_LIMIT or n >= INNER_LIMIT:
        return f"npu_grouped_matmul takes K and N below {INNER_LIMIT}"
    if num_rows == 0:
        return "no rows"
    return None


def _gemm(x_sorted: Tensor, w: Tensor, cumulative_rows: Tensor) -> Tensor:
    """y [M, N] = rows of each expert times its w[e]^T; w [E, N, K] goes in as the transposed view [E, K, N]."""
    w_t = w.transpose(1, 2)
    if not (w.is_contiguous() or w_t.is_contiguous()):
        w_t = w.contiguous().transpose(1, 2)  # the kernel takes w or its transpose dense: a copy for other views
    (y,) = npu().npu_grouped_matmul(
        [x_sorted.contiguous()],
        [w_t],  # the kernel takes a transposed weight; no copy for a dense w
        group_list=cumulative_rows,
        split_item=2,
        group_type=0,
        group_list_type=0,
    )
    return y


def grouped_matmul(x_sorted, w, expert_offsets):
    """glm5_hal.grouped_matmul on torch_npu: x_sorted [M, K], w [E, N, K], expert_offsets [E+1] int64 -> [M, N]."""
    unsupported = _gemm_unsupported(x_sorted.shape[0], w)
    if unsupported is not None:
        return portable("grouped_matmul", unsupported)(x_sorted, w, expert_offsets)
    return _gemm(x_sorted, w, group_list(expert_offsets, cumulative=True))


def _unpermute(y_sorted: Tensor, sorted_indices: Tensor, topk_weights: Tensor) -> Tensor:
    # probs in the tokens' dtype: the kernel's dtype table lists matching dtypes, not mixes.
    return npu().npu_moe_token_unpermute(
        y_sorted.contiguous(), sorted_indices.to(torch.int32), probs=topk_weights.to(y_sorted.dtype)
    )


def moe_combine(y_sorted, src_index, topk_weights):
    """glm5_hal.moe_combine on torch_npu: y_sorted [T*k, D], src_index [T*k] int64, topk_weights [T, k] fp32
    -> out [T, D] = sum_j topk_weights[t, j] * (the row that came from assignment t*k + j)."""
    if topk_weights.shape[1] > MAX_UNPERMUTE_TOPK or y_sorted.shape[0] == 0:
        return portable("moe_combine", "npu_moe_token_unpermute takes 1..512 experts per token")(
            y_sorted, src_index, topk_weights
        )
    return _unpermute(y_sorted, invert_permutation(src_index), topk_weights)


def fused_moe(x, topk_weights, topk_ids, w13, w2):
    """glm5_hal.fused_moe on torch_npu: x [T, D], topk_weights [T, k] fp32, topk_ids [T, k], w13 [E, 2I, D],
    w2 [E, D, I] -> out [T, D]."""
    num_experts = w13.shape[0]
    unsupported = (
        _routing_unsupported(x, topk_ids, num_experts)
        or _gemm_unsupported(x.shape[0], w13)
        or _gemm_unsupported(x.shape[0], w2)
    )
    if unsupported is None and topk_ids.shape[1] > MAX_UNPERMUTE_TOPK:
        unsupported = "npu_moe_token_unpermute takes at most 512 experts per token"
    # The chain's kernels keep the intermediates in bf16 / fp16: fp16, and bf16 with few outputs per token, miss the
    # tolerance there (glm5_hal.vendor_precision, measured on the strict fake).
    unsupported = unsupported or fused_moe_chain_unsupported(x.dtype, x.shape[1])
    if unsupported is not None:
        return portable("fused_moe", unsupported)(x, topk_weights, topk_ids, w13, w2)
    # row_idx_type 0: row_idx[assignment] = its row, the index npu_moe_token_unpermute gathers with.
    x_sorted, row_of_assignment, offsets = _routing(x, topk_ids, num_experts, row_idx_type=0)
    rows = group_list(offsets, cumulative=True)
    hidden = npu().npu_swiglu(_gemm(x_sorted, w13, rows), dim=-1)  # silu(gate) * up, gate = first half
    return _unpermute(_gemm(hidden, w2, rows), row_of_assignment, topk_weights)
