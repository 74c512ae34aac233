"""Mixture of experts: [gate] -> [dispatch] -> [grouped GEMMs] -> [combine], and `fused_moe` of all four.

Routing weights are applied in `moe_combine` only. The expert GEMMs run one expert at a time: eager PyTorch has no
portable ragged (segment) GEMM, so the loop over experts is the one unavoidable loop, and it skips experts with no
rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from backends.torch_eager.gemm import Gemm, RoutedGemm, gemm_for
from backends.torch_eager.primitives import COMPUTE_DTYPE


def _descending_order(values: Tensor, k: int) -> Tensor:
    """[..., k] int64 indices (contiguous) of the k largest values per row, largest first, NaN first, ties to the
    lower index (the reference's rule: torch's sort ranks NaN above every number; torch.topk leaves tie order
    unspecified)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()


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
    """DeepSeek noaux_tc routing (validated by glm5_hal.moe_gate).

    router_logits: [T, E] fp32. bias: [E] fp32 or None, for selection only. With n_group > 1 only the topk_group
    groups with the largest sum of their two best biased scores compete.

    Returns (topk_weights [T, top_k] fp32: unbiased scores, normalised if norm_topk_prob, times
    routed_scaling_factor; topk_ids [T, top_k] int32, best biased score first).
    """
    logits = router_logits.to(COMPUTE_DTYPE)
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)  # [T, E]
    biased = scores if bias is None else scores + bias.to(COMPUTE_DTYPE)
    if n_group > 1:
        num_tokens, num_experts = biased.shape
        grouped = biased.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, _descending_order(group_scores, topk_group), True)
        biased = grouped.masked_fill(~kept[..., None], float("-inf")).view(num_tokens, num_experts)
    ids = _descending_order(biased, top_k)  # [T, top_k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def moe_dispatch(x: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group token copies by expert (validated by glm5_hal.moe_dispatch).

    x: [T, D]. topk_ids: [T, k] int32/int64 in [0, E).

    Returns (x_sorted [T * k, D] in x's dtype, expert_offsets [E + 1] int64, src_index [T * k] int64): rows by
    expert ascending, in assignment order t * k + j within an expert; src_index[r] is row r's assignment.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).to(torch.int64)  # [T * k], assignment a = t * k + j
    sorted_ids, src_index = torch.sort(flat_ids, stable=True)
    # offsets[e] = assignments to experts < e; searchsorted needs no host sync (bincount's output size would).
    experts = torch.arange(num_experts + 1, device=x.device)
    expert_offsets = torch.searchsorted(sorted_ids, experts)
    return x[src_index // top_k], expert_offsets, src_index


def _grouped_linear(x: Tensor, w: Tensor, row_ends: list[int], gemm: Gemm | RoutedGemm, output: bool = False) -> Tensor:
    """x: [M, K] grouped by expert (any float dtype); w: [E, N, K]; row_ends: [E + 1] host ints. Returns [M, N]
    fp32. output: y is the op's output (Gemm.linear)."""
    y = x.new_empty(x.shape[0], w.shape[1], dtype=COMPUTE_DTYPE)
    # The unavoidable loop over experts (see the module docstring); only experts that own rows cost a GEMM.
    for expert in range(w.shape[0]):
        lo, hi = row_ends[expert], row_ends[expert + 1]
        if hi > lo:
            y[lo:hi] = gemm.linear(x[lo:hi], w[expert], output=output)
    return y


def _host_offsets(expert_offsets: Tensor) -> list[int]:
    # The host needs the row ranges to slice per expert: one device-to-host read per call.
    return expert_offsets.tolist()


def grouped_matmul(x_sorted: Tensor, w: Tensor, expert_offsets: Tensor) -> Tensor:
    """y[r] = x_sorted[r] @ w[e(r)]^T (validated by glm5_hal.grouped_matmul).

    x_sorted: [M, K]; w: [E, N, K]; expert_offsets: [E + 1] int64 row ranges. Returns y [M, N] in x_sorted's
    dtype, fp32 accumulation.
    """
    gemm = gemm_for(x_sorted.dtype, x_sorted.device)
    y = _grouped_linear(x_sorted, w, _host_offsets(expert_offsets), gemm, output=True)
    return y.to(x_sorted.dtype)


def _combine(y_sorted: Tensor, src_index: Tensor, topk_weights: Tensor) -> Tensor:
    """fp32 [T, D] = sum_j topk_weights[t, j] * y_sorted[row of assignment t * k + j]."""
    num_tokens, top_k = topk_weights.shape
    # Undo the dispatch permutation: row r of y_sorted belongs to assignment src_index[r].
    by_assignment = torch.empty_like(y_sorted).index_copy_(0, src_index, y_sorted)
    by_assignment = by_assignment.view(num_tokens, top_k, y_sorted.shape[1]).to(COMPUTE_DTYPE)  # [T, k, D]
    return torch.bmm(topk_weights.to(COMPUTE_DTYPE).unsqueeze(1), by_assignment).squeeze(1)  # [T, D]


def moe_combine(y_sorted: Tensor, src_index: Tensor, topk_weights: Tensor) -> Tensor:
    """Weighted sum of each token's expert outputs (validated by glm5_hal.moe_combine).

    y_sorted: [T * k, D]; src_index: [T * k] int64 (a permutation, from moe_dispatch); topk_weights: [T, k] fp32.
    Returns out [T, D] in y_sorted's dtype, fp32 accumulation.
    """
    return _combine(y_sorted, src_index, topk_weights).to(y_sorted.dtype)


def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Routed experts of one MoE layer (validated by glm5_hal.fused_moe).

    x: [T, D]; topk_weights: [T, k] fp32; topk_ids: [T, k]; w13: [E, 2I, D] (gate rows, then up rows); w2:
    [E, D, I]. Returns out [T, D] in x's dtype; every intermediate is fp32.
    """
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    gemm = gemm_for(x.dtype, x.device)
    x_sorted, expert_offsets, src_index = moe_dispatch(x, topk_ids, num_experts)
    row_ends = _host_offsets(expert_offsets)
    h = _grouped_linear(x_sorted, w13, row_ends, gemm)  # [T * k, 2I] fp32
    activated = F.silu(h[:, :inter]) * h[:, inter:]  # [T * k, I] fp32 (not rounded: Gemm splits it)
    y = _grouped_linear(activated, w2, row_ends, gemm)  # [T * k, D] fp32
    return _combine(y, src_index, topk_weights).to(x.dtype)
