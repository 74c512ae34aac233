"""Lightning indexer (OPS.md section 2): per-token key scores and the top-k key selection of DSA."""

from __future__ import annotations

import numpy as np

from ops_reference.kv_cache import AUTO, dequantize_cache
from ops_reference.norms import layer_norm
from ops_reference.paged_cache import addressable, gather_keys, token_positions, token_sequences, write_cache
from ops_reference.ranking import descending_nan_first
from ops_reference.rope import rope


def indexer_prolog(
    x,
    q_norm,
    w_iq,
    w_ik,
    k_norm_weight,
    k_norm_bias,
    w_iw,
    cos,
    sin,
    index_k_cache,
    slot_mapping,
    *,
    rope_interleaved,
    eps=1e-6,
    kv_cache_dtype=AUTO,
):
    """-> (q_idx [T,HI,DI], weights [T,HI], new index_k_cache).

    q_idx = q_norm @ w_iq^T per head; k = LayerNorm(x @ w_ik^T); RoPE on the FIRST rope dims of both (the
    model's indexer layout); weights = (x @ w_iw^T) * HI^-0.5 * DI^-0.5. The k rows go to the cache (encoded
    when kv_cache_dtype names an index format of ops_reference.kv_cache).
    """
    num_heads, head_dim = w_iw.shape[0], w_ik.shape[0]
    rope_dim = 2 * cos.shape[1]
    q = (np.asarray(q_norm, np.float64) @ w_iq.T).reshape(-1, num_heads, head_dim)
    k = layer_norm(np.asarray(x, np.float64) @ w_ik.T, k_norm_weight, k_norm_bias, eps)
    q[..., :rope_dim] = rope(q[..., :rope_dim], cos, sin, interleaved=rope_interleaved)
    k[..., :rope_dim] = rope(k[..., :rope_dim], cos, sin, interleaved=rope_interleaved)
    weights = (np.asarray(x, np.float64) @ w_iw.T) * num_heads**-0.5 * head_dim**-0.5
    return q, weights, write_cache(index_k_cache, slot_mapping, k, kv_cache_dtype)


def indexer_logits(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype=AUTO):
    """-> [T, max_blocks * block_size] scores I[t,s] = sum_j w[t,j] * ReLU(q[t,j] . k[s]); -inf where s is not
    visible to token t (s > its position, or a key its block table does not address: paged_cache.addressable). A
    quantized cache is read as its decoded values."""
    index_k_cache = dequantize_cache(index_k_cache, kv_cache_dtype)
    num_tokens, width = q_idx.shape[0], block_table.shape[1] * index_k_cache.shape[1]
    seqs, positions = token_sequences(cu_seqlens_q), token_positions(seq_lens_k, cu_seqlens_q)
    logits = np.full((num_tokens, width), -np.inf)
    for t in range(num_tokens):
        visible = np.arange(min(positions[t] + 1, width))
        visible = visible[addressable(block_table, index_k_cache.shape[0], index_k_cache.shape[1], seqs[t], visible)]
        keys = gather_keys(index_k_cache, block_table, seqs[t], visible)  # [S, DI]
        relu_dots = np.maximum(np.asarray(q_idx[t], np.float64) @ keys.T, 0.0)  # [HI, S]
        logits[t, visible] = np.asarray(weights[t], np.float64) @ relu_dots
    return logits


def lightning_indexer(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, topk, kv_cache_dtype=AUTO):
    """-> (indices int32 [T,topk], scores [T,topk]): the top-topk visible key positions per token, best first;
    equal scores rank by the lower key position (so the set is unique); when fewer keys are visible, all of them
    and then -1 (score -inf). A NaN score ranks above every number, so a key scored NaN is picked first, with its
    position and its NaN score (docs/ops.md "NaN")."""
    logits = indexer_logits(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype)
    # Stable: equal scores (-0.0 and +0.0 included) and NaN with NaN keep position order.
    order = descending_nan_first(logits)[:, :topk]
    scores = np.take_along_axis(logits, order, axis=1)
    if order.shape[1] < topk:  # a cache narrower than topk: pad the columns
        pad = topk - order.shape[1]
        order = np.pad(order, ((0, 0), (0, pad)))
        scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
    indices = np.where(scores == -np.inf, -1, order).astype(np.int32)  # -inf: not visible
    return indices, scores
