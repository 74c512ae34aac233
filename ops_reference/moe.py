"""MoE routing, dispatch, expert GEMMs and combine (OPS.md section 4)."""

from __future__ import annotations

import numpy as np

from ops_reference.ranking import descending_nan_first


def _topk_desc(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of each row, largest first; NaN ranks above every number (docs/ops.md
    "NaN"); ties, NaN with NaN included, go to the lower index."""
    return descending_nan_first(values)[..., :k]


def moe_gate(router_logits, bias, *, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, scoring):
    """-> (topk_weights [T,k], topk_ids int32 [T,k]).

    Scores s = sigmoid(logits) (or softmax); s + bias picks the experts (bias never weights them). With
    n_group > 1 only the topk_group groups with the largest sum of their top-2 biased scores compete.
    """
    logits = np.asarray(router_logits, np.float64)
    if scoring == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-logits))
    elif scoring == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        s = e / e.sum(axis=-1, keepdims=True)
    else:
        raise ValueError(f"scoring: expected 'sigmoid' or 'softmax', got {scoring!r}")
    sb = s if bias is None else s + np.asarray(bias, np.float64)
    if n_group > 1:
        num_tokens, num_experts = sb.shape
        grouped = sb.reshape(num_tokens, n_group, num_experts // n_group)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # [T, n_group]
        keep = np.zeros((num_tokens, n_group), bool)
        np.put_along_axis(keep, _topk_desc(group_scores, topk_group), True, axis=1)
        sb = np.where(np.repeat(keep, num_experts // n_group, axis=1), sb, -np.inf)
    ids = _topk_desc(sb, top_k)
    weights = np.take_along_axis(s, ids, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, ids.astype(np.int32)


def moe_dispatch(x, topk_ids, num_experts):
    """-> (x_sorted [T*k,D], expert_offsets int64 [E+1], src_index int64 [T*k]).

    Assignment a = t*k + j goes to expert topk_ids[t,j]; rows are grouped by expert ascending, in assignment
    order within an expert; src_index[r] is the assignment of row r.
    """
    flat_ids = np.asarray(topk_ids, np.int64).reshape(-1)
    src_index = np.argsort(flat_ids, kind="stable")
    counts = np.bincount(flat_ids, minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    top_k = np.asarray(topk_ids).shape[1]
    return np.asarray(x, np.float64)[src_index // top_k], offsets, src_index.astype(np.int64)


def grouped_matmul(x_sorted, w, expert_offsets):
    """-> y [M,N]: rows expert_offsets[e] : expert_offsets[e+1] of x_sorted [M,K] times w[e]^T (w [E,N,K])."""
    x_sorted, w = np.asarray(x_sorted, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x_sorted.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        rows = slice(expert_offsets[e], expert_offsets[e + 1])
        y[rows] = x_sorted[rows] @ w[e].T
    return y


def moe_combine(y_sorted, src_index, topk_weights):
    """-> out [T,D] = sum_j topk_weights[t,j] * (the row of y_sorted that came from assignment t*k + j)."""
    num_tokens, top_k = np.asarray(topk_weights).shape
    width = np.asarray(y_sorted).shape[1]
    by_assignment = np.zeros((num_tokens * top_k, width))
    by_assignment[np.asarray(src_index, np.int64)] = y_sorted
    weights = np.asarray(topk_weights, np.float64)
    return np.einsum("tkd,tk->td", by_assignment.reshape(num_tokens, top_k, width), weights)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def fused_moe(x, topk_weights, topk_ids, w13, w2):
    """-> out [T,D]: dispatch, h = x @ w13^T split [gate | up], silu(gate) * up, @ w2^T, weighted combine.
    w13 [E, 2I, D]; w2 [E, D, I]."""
    x_sorted, offsets, src_index = moe_dispatch(x, topk_ids, w13.shape[0])
    h = grouped_matmul(x_sorted, w13, offsets)
    inter = h.shape[1] // 2
    y = grouped_matmul(silu(h[:, :inter]) * h[:, inter:], w2, offsets)
    return moe_combine(y, src_index, topk_weights)
