"""Fake vllm-kunlun sparse MLA kernels: sparse_prefill_fwd_opt (prefill) and fwd_kvcache_mla with indices (decode).

Semantics from vllm_kunlun/ops/attention/flashmla.py (the docstrings of flash_mla_sparse_prefill and
kunlun_flash_mla_with_kvcache) and their caller v1/attention/backends/mla/flashmla_sparse.py:
- both read one flat cache kv [s_kv, 576] (the paged cache viewed as rows) through `indices` that are already flat
  rows (the caller converts request-local positions with the block table); an index of -1 or >= s_kv is invalid,
  anywhere in its row; K = the whole row, V = its first d_v = 512 values; bf16;
- prefill: q [s_q, h_q, 576], indices [s_q, h_kv = 1, topk], q_lod [batch + 1]; writes out [s_q, h_q, 512],
  max_logits and lse [s_q, h_q] fp32. The docstring calls lse "2-based" (copied from FlashMLA) while the note in
  the same function says it is the CUDA kernel's base-2 value times 1 / log2(e), i.e. natural-log: the fake follows
  the Kunlun-specific note (natural lse and max_logits, in units of sm_scale * q.k). Only hardware can settle it.
  The only caller passes kv lods equal to the query's and is_causal=True, whose meaning over flat indices is not
  documented (the caller's own comment asks why): the fake takes exactly that call and nothing else;
- decode: q_c [B, s_q <= 2, h_q, 576], indices [B, s_q, topk], kv_lod_cpu / kv_lod_xpu = the sequences' key counts
  [B] (the caller passes seq_lens), max_seq_kv >= each; writes out [B, s_q, h_q, 512] and the softmax statistics
  max_logits (max of sm_scale * q.k) and p_sums (sum of exp(score - max_logits)) [B, s_q, h_q] fp32.
A token without a valid index gets undefined results (FlashMLA's README gives 0 and +inf; Kunlun says nothing):
poisoned.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.kunlun.common import not_modeled, require, require_lengths, require_output
from fakes.schema_fake import device_tensor, host

LATENT = 512  # d_v: "Can only be 512"


def _attend(op: str, q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float) -> tuple[np.ndarray, ...]:
    """q [N, H, D] bf16, kv [S, D] bf16, indices [N, topk] flat rows -> (out [N, H, 512], max [N, H], lse [N, H],
    empty [N]) in float64, natural log."""
    require(
        q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16,
        op,
        f"q and kv must be bfloat16, got {q.dtype}/{kv.dtype}",
    )
    require(
        kv.dim() == 2 and kv.is_contiguous() and kv.shape[1] == q.shape[-1],
        op,
        f"kv must be contiguous [s_kv, {q.shape[-1]}], got {tuple(kv.shape)}",
    )
    require(q.shape[-1] > LATENT, op, f"d_qk must exceed d_v = {LATENT}")
    require(indices.dtype == torch.int32, op, f"indices must be int32, got {indices.dtype}")
    rows, idx, queries = host(kv), host(indices), host(q)
    s_kv = rows.shape[0]
    require(bool((idx >= -1).all()), op, "an invalid index must be -1 (or >= s_kv)")
    valid = (idx >= 0) & (idx < s_kv)
    # The contract's reference on one sequence holding every row: its invalid entries are the kernel's.
    out, lse = ref.sparse_flash_attention(
        queries,
        rows[None],
        np.where(valid, idx, -1),
        np.zeros((1, 1), np.int64),
        np.array([s_kv]),
        np.array([0, queries.shape[0]]),
        sm_scale,
        LATENT,
    )
    peak = np.full(lse.shape, -np.inf)
    for t in range(queries.shape[0]):
        keys = rows[idx[t][valid[t]]]
        if keys.shape[0]:
            peak[t] = (sm_scale * (queries[t] @ keys.T)).max(axis=1)
    return out, peak, lse, ~valid.any(axis=1)


def _lod(op: str, name: str, t: Tensor | None, total: int, device: str | None) -> np.ndarray:
    require(t is not None, op, f"{name} is required")
    require(t.dtype == torch.int32 and t.dim() == 1 and t.numel() >= 2, op, f"{name} must be int32 [batch + 1]")
    if device is not None:
        require(t.device.type == device, op, f"{name} must be on the {device}")
    lod = host(t)
    require(
        lod[0] == 0 and lod[-1] == total and bool((np.diff(lod) >= 0).all()),
        op,
        f"{name} must be non-decreasing offsets from 0 to {total}, got {lod.tolist()}",
    )
    return lod


def sparse_prefill_fwd_opt(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    out: Tensor,
    max_logits: Tensor,
    lse: Tensor,
    sm_scale: float,
    qlod_cpu: Tensor | None = None,
    qlod_xpu: Tensor | None = None,
    kvlod_cpu: Tensor | None = None,
    kvlod_xpu: Tensor | None = None,
    d_v: int | None = -1,
    is_causal: bool | None = True,
    use_xfa_boost: bool | None = False,
) -> None:
    op = "sparse_prefill_fwd_opt"
    not_modeled(not use_xfa_boost, op, "use_xfa_boost")
    require(d_v == LATENT, op, f"d_v can only be {LATENT}, got {d_v}")
    require(q.dim() == 3, op, f"q must be [s_q, h_q, d_qk], got {tuple(q.shape)}")
    s_q, heads, _ = q.shape
    require(
        indices.dim() == 3 and indices.shape[:2] == (s_q, 1),
        op,
        f"indices must be [s_q, h_kv = 1, topk], got {tuple(indices.shape)}",
    )
    lod = _lod(op, "qlod_cpu", qlod_cpu, s_q, "cpu")
    require(qlod_xpu is not None and np.array_equal(host(qlod_xpu), lod), op, "qlod_xpu must hold qlod_cpu's values")
    not_modeled(
        is_causal and all(t is not None and np.array_equal(host(t), lod) for t in (kvlod_cpu, kvlod_xpu)),
        op,
        "kv lods other than the query's, or is_causal=False (vllm-kunlun's only call passes both as the query's lod "
        "with is_causal=True)",
    )
    require_output(op, "out", out, ((s_q, heads, LATENT),), q.dtype)
    require_output(op, "max_logits", max_logits, ((s_q, heads),), torch.float32)
    require_output(op, "lse", lse, ((s_q, heads),), torch.float32)
    values, peak, natural, empty = _attend(op, q, kv, indices[:, 0], sm_scale)
    for target, result in ((out, values), (max_logits, peak), (lse, natural)):
        target.copy_(_defined(result, empty, target, q))


def fwd_kvcache_mla(
    q_c: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    kv_lod_cpu: Tensor,
    out: Tensor,
    max_logits: Tensor,
    p_sums: Tensor,
    softmax_scale: float,
    max_seq_kv: int,
    q_r: Tensor | None = None,
    pe_cache: Tensor | None = None,
    use_xfa_boost: bool | None = False,
    kv_lod_xpu: Tensor | None = None,
) -> None:
    op = "fwd_kvcache_mla"
    not_modeled(q_r is None and pe_cache is None, op, "a separate rope query / cache (q_r, pe_cache)")
    not_modeled(not use_xfa_boost, op, "use_xfa_boost")
    require(q_c.dim() == 4, op, f"q_c must be [batch, seq_len_q, h_q, d_qk], got {tuple(q_c.shape)}")
    batch, s_q, heads, _ = q_c.shape
    require(s_q <= 2, op, f"only seq_len_q <= 2 is supported, got {s_q}")
    require(
        indices.dim() == 3 and indices.shape[:2] == (batch, s_q),
        op,
        f"indices must be [batch, seq_len_q, topk], got {tuple(indices.shape)}",
    )
    require_lengths(op, "kv_lod_cpu", kv_lod_cpu, (batch,), "cpu")
    lengths = host(kv_lod_cpu)
    require(
        kv_lod_xpu is not None and np.array_equal(host(kv_lod_xpu), lengths),
        op,
        "kv_lod_xpu must hold kv_lod_cpu's values",
    )
    require(max_seq_kv >= lengths.max(initial=0), op, f"max_seq_kv {max_seq_kv} is below a sequence's length")
    require_output(op, "out", out, ((batch, s_q, heads, LATENT),), q_c.dtype)
    require_output(op, "max_logits", max_logits, ((batch, s_q, heads),), torch.float32)
    require_output(op, "p_sums", p_sums, ((batch, s_q, heads),), torch.float32)
    values, peak, natural, empty = _attend(
        op, q_c.reshape(batch * s_q, heads, -1), kv_cache, indices.reshape(batch * s_q, -1), softmax_scale
    )
    with np.errstate(invalid="ignore"):
        sums = np.exp(natural - peak)
    for target, result in ((out, values), (max_logits, peak), (p_sums, sums)):
        target.copy_(_defined(result, empty, target, q_c))


def _defined(result: np.ndarray, empty: np.ndarray, target: Tensor, like: Tensor) -> Tensor:
    """result [N, ...] (N tokens, flattened however `target` lays them out) with the empty tokens' values poisoned."""
    values = result.copy()
    values[empty] = np.nan
    return device_tensor(values, target.dtype, like).view(target.shape)
