"""Fake vllm-kunlun indexer kernels: I8_mqa_logits (prefill), I8_paged_mqa_logits (decode) and fast_topkv2.

Semantics from vllm_kunlun/ops/deep_gemm.py (int8_mqa_logits / int8_paged_mqa_logits, whose docstrings follow
DeepGEMM's fp8 MQA logits) and the indexer in vllm_kunlun/models/deepseek_v2.py, which quantizes the query with
quant2d per (token, head) and folds its scale max / 127 into the head weights:
- logits[m, n] = sum_h weights[m, h] * ReLU(q[m, h] . k[n] * k_scale[n]); q and k int8, k_scale fp32 (the
  dequantization scale of key n), weights fp32;
- I8_mqa_logits: keys [N, D] contiguous with k_scale [N] or [N, 1]; the caller passes one sequence,
  context_q_lens = (cpu, device) [0, M] and context_k_lens = [0, N], clean_logits=True and no causal mask (it masks
  afterwards): exactly that call is modeled; -> logits [M, N];
- I8_paged_mqa_logits: q [B, next_n, H, D], keys [blocks, block_size, 1, D] read through block_table, k_scale
  [B, max_context_len] (per sequence position, gathered by the caller), context_lens (cpu, device) [B]; query i of
  sequence b sees keys s <= context_lens[b] - next_n + i; clean_logits=True sets every other logit up to
  max_context_len (a multiple of the block size, the caller's comment says) to -inf; -> out [B, next_n,
  max_context_len].
- fast_topkv2(score [T, S] fp32, lengths [T] int32, topk = 2048 only): the top-2048 columns among the first
  lengths[t], all of them and then -1 where lengths[t] <= 2048. Neither the order of the result nor which of
  equal scores is kept is documented: the fake returns the set by descending column and keeps the HIGHER columns
  among ties (the contract keeps the lower), so that nothing may rely on either.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fakes.kunlun.common import not_modeled, require, require_lengths, require_output
from fakes.schema_fake import device_tensor, host

TOPK = 2048


def _scores(q: np.ndarray, weights: np.ndarray, keys: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """q [M, H, D], weights [M, H], keys [N, D], scales [N] (or [M, N] per query row) -> [M, N]."""
    dots = np.einsum("mhd,nd->mhn", q, keys)  # exact: int8 products summed in float64
    dots = dots * (scales[:, None, :] if scales.ndim == 2 else scales[None, None, :])
    return np.einsum("mh,mhn->mn", weights, np.maximum(dots, 0.0))


def _int8_query(op: str, q: Tensor, weights: Tensor, dims: int) -> None:
    require(
        q.dtype == torch.int8 and q.dim() == dims and q.is_contiguous(),
        op,
        f"q must be contiguous int8 of {dims} dims, got {q.dtype} {tuple(q.shape)}",
    )
    require(
        weights.dtype == torch.float32 and tuple(weights.shape) == tuple(q.shape[:-1]),
        op,
        f"weights must be fp32 {tuple(q.shape[:-1])}, got {weights.dtype} {tuple(weights.shape)}",
    )


def _lens_pair(op: str, name: str, pair: list[Tensor], values: list[int] | None, shape: tuple[int, ...]) -> np.ndarray:
    require(len(pair) == 2, op, f"{name} must be [cpu tensor, device tensor]")
    require_lengths(op, f"{name}[0]", pair[0], shape, "cpu")
    require_lengths(op, f"{name}[1]", pair[1], shape)
    lengths = host(pair[0])
    require(np.array_equal(host(pair[1]), lengths), op, f"{name}'s two tensors must hold the same values")
    if values is not None:
        not_modeled(lengths.tolist() == values, op, f"{name} other than {values} (one sequence, the caller's call)")
    return lengths


def I8_mqa_logits(  # noqa: N802 (the kernel's name)
    q: Tensor,
    fused_kv_cache: list[Tensor],
    weights: Tensor,
    context_q_lens: list[Tensor],
    context_k_lens: list[Tensor],
    logits: Tensor,
    clean_logits: bool,
    max_seq_q: int | None = 0,
    max_seq_k: int | None = 0,
    is_causal: bool | None = False,
    use_xfa_boost: bool | None = False,
) -> None:
    op = "I8_mqa_logits"
    not_modeled(clean_logits and not is_causal and not use_xfa_boost, op, "clean_logits=False, is_causal, xfa boost")
    not_modeled(not max_seq_q and not max_seq_k, op, "max_seq_q / max_seq_k")
    _int8_query(op, q, weights, 3)
    require(len(fused_kv_cache) == 2, op, "fused_kv_cache must be [keys int8 [N, D], scales fp32 [N] or [N, 1]]")
    keys, scales = fused_kv_cache
    require(
        keys.dtype == torch.int8 and keys.dim() == 2 and keys.is_contiguous() and keys.shape[1] == q.shape[2],
        op,
        f"keys must be contiguous int8 [N, {q.shape[2]}], got {keys.dtype} {tuple(keys.shape)}",
    )
    n = keys.shape[0]
    require(scales.dtype == torch.float32 and tuple(scales.shape) in ((n,), (n, 1)), op, "scales must be fp32 [N]")
    _lens_pair(op, "context_q_lens", context_q_lens, [0, q.shape[0]], (2,))
    _lens_pair(op, "context_k_lens", context_k_lens, [0, n], (2,))
    require_output(op, "logits", logits, ((q.shape[0], n),), torch.float32)
    result = _scores(host(q), host(weights), host(keys), host(scales).reshape(n))
    logits.copy_(device_tensor(result, torch.float32, q))


def I8_paged_mqa_logits(  # noqa: N802 (the kernel's name)
    q: Tensor,
    fused_kv_cache: list[Tensor],
    weights: Tensor,
    context_lens: list[Tensor],
    block_table: Tensor,
    max_context_len: int,
    clean_logits: bool,
    out: Tensor,
    use_xfa_boost: bool | None = False,
) -> None:
    op = "I8_paged_mqa_logits"
    not_modeled(clean_logits and not use_xfa_boost, op, "clean_logits=False or xfa boost")
    _int8_query(op, q, weights, 4)
    batch, next_n, _, dim = q.shape
    require(len(fused_kv_cache) == 2, op, "fused_kv_cache must be [keys int8 [blocks, bs, 1, D], scales fp32 [B, L]]")
    keys, scales = fused_kv_cache
    require(
        keys.dtype == torch.int8 and keys.dim() == 4 and keys.shape[2:] == (1, dim) and keys.is_contiguous(),
        op,
        f"keys must be contiguous int8 [blocks, block_size, 1, {dim}], got {keys.dtype} {tuple(keys.shape)}",
    )
    blocks, block_size = keys.shape[:2]
    require(max_context_len % block_size == 0, op, f"max_context_len must be a multiple of the block size {block_size}")
    require(
        scales.dtype == torch.float32 and tuple(scales.shape) == (batch, max_context_len),
        op,
        f"scales must be fp32 [B, max_context_len] = {(batch, max_context_len)}, got {tuple(scales.shape)}",
    )
    lengths = _lens_pair(op, "context_lens", context_lens, None, (batch,))
    require(
        bool((lengths >= next_n).all() and (lengths <= max_context_len).all()),
        op,
        f"context_lens must lie in [next_n, max_context_len], got {lengths.tolist()}",
    )
    require(
        block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch,
        op,
        "block_table must be int32 [B, max_blocks]",
    )
    require(block_table.shape[1] * block_size >= max_context_len, op, "block_table too narrow for max_context_len")
    table = host(block_table)
    require_output(op, "out", out, ((batch, next_n, max_context_len),), torch.float32)
    codes, queries, head_weights, scale = host(keys)[:, :, 0], host(q), host(weights), host(scales)
    result = np.full((batch, next_n, max_context_len), -np.inf)
    for b in range(batch):
        used = -(-int(lengths[b]) // block_size)
        require(
            bool(((table[b, :used] >= 0) & (table[b, :used] < blocks)).all()),
            op,
            f"block_table row {b} points outside the cache",
        )
        seq_keys = codes[table[b, :used]].reshape(used * block_size, dim)[: lengths[b]]
        scores = _scores(queries[b], head_weights[b], seq_keys, scale[b, : lengths[b]])  # [next_n, len]
        for i in range(next_n):
            visible = int(lengths[b]) - next_n + i + 1
            result[b, i, :visible] = scores[i, :visible]
    out.copy_(device_tensor(result, torch.float32, q))


def fast_topkv2(score: Tensor, lengths: Tensor, topk: int | None = TOPK) -> Tensor:
    op = "fast_topkv2"
    require(topk == TOPK, op, f"fast_topkv2 only supports topk = {TOPK} (the wrapper asserts it), got {topk}")
    require(score.dtype == torch.float32 and score.dim() == 2, op, f"score must be fp32 [T, S], got {score.dtype}")
    rows, width = score.shape
    require_lengths(op, "lengths", lengths, (rows,))
    counts = host(lengths)
    require(bool(((counts >= 0) & (counts <= width)).all()), op, f"lengths must lie in [0, {width}]")
    values = host(score)
    not_modeled(not np.isnan(values).any(), op, "NaN scores (their rank is not documented)")
    result = np.full((rows, TOPK), -1, np.int64)
    for t in range(rows):
        n = int(counts[t])
        if n <= TOPK:
            result[t, :n] = np.arange(n)
            continue
        # Best score first, the HIGHER column first among equal scores; the set returned by descending column.
        order = np.lexsort((-np.arange(n), -values[t, :n]))[:TOPK]
        result[t] = np.sort(order)[::-1]
    return device_tensor(result, torch.int32, score)
