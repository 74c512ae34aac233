"""Sparse flash attention over absorbed MLA (OPS.md section 3), and dense MLA attention for comparison."""

from __future__ import annotations

import numpy as np

from ops_reference.kv_cache import AUTO, dequantize_cache
from ops_reference.paged_cache import addressable, gather_keys, token_positions, token_sequences


def _attend(q: np.ndarray, keys: np.ndarray, sm_scale: float, d_v: int) -> tuple[np.ndarray, np.ndarray]:
    """q [H, D] over keys [S, D] (V = first d_v dims) -> (out [H, d_v], natural-log lse [H]); S = 0 -> (0, -inf).

    A head whose scores are all -inf (infinite inputs) is an empty softmax: out = 0 and lse = log(0) = -inf, as for
    no key at all, whatever V holds (docs/ops.md "Edge rules"). NaN and +inf scores propagate."""
    if keys.shape[0] == 0:
        return np.zeros((q.shape[0], d_v)), np.full(q.shape[0], -np.inf)
    scores = sm_scale * (q @ keys.T)  # [H, S]
    peak = scores.max(axis=1, keepdims=True)
    peak = np.where(peak == -np.inf, 0.0, peak)  # all -inf: shift by 0 (-inf - -inf would be NaN); exp gives 0
    p = np.exp(scores - peak)
    total = p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the answer for an empty softmax
        lse = (peak + np.log(total))[:, 0]
    empty = total == 0  # [H, 1]
    with np.errstate(invalid="ignore"):  # 0 * inf in an empty head's product: replaced by 0 below
        out = (p / np.where(empty, 1.0, total)) @ keys[:, :d_v]
    return np.where(empty, 0.0, out), lse


def sparse_flash_attention(
    q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v=512, kv_cache_dtype=AUTO
):
    """-> (out [T,H,d_v], lse [T,H]). Token t attends to the cache rows of its valid indices (>= 0, < seq_lens_k of
    its sequence, and addressed by its block table: paged_cache.addressable); K = the whole row, V = its first d_v
    dims. A quantized cache is read as its decoded values."""
    q = np.asarray(q, np.float64)
    kv_cache = dequantize_cache(kv_cache, kv_cache_dtype)
    seqs, seq_lens_k = token_sequences(cu_seqlens_q), np.asarray(seq_lens_k, np.int64)
    out, lse = np.zeros((q.shape[0], q.shape[1], d_v)), np.zeros(q.shape[:2])
    for t in range(q.shape[0]):
        idx = np.asarray(indices[t], np.int64)
        idx = idx[(idx >= 0) & (idx < seq_lens_k[seqs[t]])]
        idx = idx[addressable(block_table, kv_cache.shape[0], kv_cache.shape[1], seqs[t], idx)]
        out[t], lse[t] = _attend(q[t], gather_keys(kv_cache, block_table, seqs[t], idx), sm_scale, d_v)
    return out, lse


def dense_mla_attention(q, kv_cache, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v=512):
    """Causal attention over every visible key (what sparse attention equals when topk covers the context)."""
    q = np.asarray(q, np.float64)
    seqs, positions = token_sequences(cu_seqlens_q), token_positions(seq_lens_k, cu_seqlens_q)
    out, lse = np.zeros((q.shape[0], q.shape[1], d_v)), np.zeros(q.shape[:2])
    for t in range(q.shape[0]):
        keys = gather_keys(kv_cache, block_table, seqs[t], np.arange(positions[t] + 1))
        out[t], lse[t] = _attend(q[t], keys, sm_scale, d_v)
    return out, lse
