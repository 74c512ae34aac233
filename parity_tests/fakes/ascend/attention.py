"""Fake torch_npu DSA kernels: npu_lightning_indexer and npu_sparse_flash_attention, computed with ops_reference.

Both take a ragged batch: TND queries with prefix-sum lengths, and keys either paged (PA_BSND + block_table +
per-sequence lengths) or packed (TND + prefix sums). sparse_mode 3 ("rightDownCausal") puts query token i of a
sequence with q_len new tokens and kv_len keys at position kv_len - q_len + i and hides keys after it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.ascend.common import HALF_DTYPES, device_tensor, host, not_modeled, require

MAX_INT64 = 9223372036854775807
SPARSE_COUNTS = set(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
SFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def _prefix_sums(op: str, name: str, t: Tensor | None, total: int) -> np.ndarray:
    """A documented prefix-sum length tensor: 1-D int32, non-decreasing, non-negative, last value = total.
    Returns the [B+1] cumulative form starting at 0."""
    require(t is not None, op, f"{name} is required with a TND layout")
    require(
        t.dtype == torch.int32 and t.dim() == 1,
        op,
        f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}",
    )
    values = host(t)
    require(
        bool((values >= 0).all() and (np.diff(values) >= 0).all()), op, f"{name} must be non-decreasing prefix sums"
    )
    require(
        values.size > 0 and values[-1] == total,
        op,
        f"{name} must end at the token count {total}, got {values.tolist()}",
    )
    return np.concatenate([[0], values])


def _seq_lengths(op: str, name: str, t: Tensor | None, batch: int) -> np.ndarray:
    require(t is not None, op, f"{name} is required with a PA_BSND key layout")
    require(t.dtype == torch.int32 and tuple(t.shape) == (batch,), op, f"{name} must be [B] int32 with B = {batch}")
    values = host(t)
    require(bool((values >= 0).all()), op, f"{name} must be non-negative")
    return values


def _block_table(op: str, block_table: Tensor | None, lengths: np.ndarray, block_size: int, blocks: int) -> np.ndarray:
    require(block_table is not None, op, "block_table is required with a PA_BSND key layout")
    require(block_table.dtype == torch.int32 and block_table.dim() == 2, op, "block_table must be 2-D int32")
    table = host(block_table)
    needed = -(-lengths // block_size)  # blocks each sequence's keys occupy
    require(table.shape[0] == lengths.size and table.shape[1] >= needed.max(initial=0), op, "block_table too small")
    for b, n in enumerate(needed):
        require(bool(((table[b, :n] >= 0) & (table[b, :n] < blocks)).all()), op, f"block_table row {b} points outside")
    return table


def _causal_keep(indices: np.ndarray, cu_q: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """[T, k] mask of index entries at or before their query token's position (sparse_mode 3)."""
    return indices <= ref.token_positions(kv_lens, cu_q)[:, None]


def _sparse_indices(op: str, indices: np.ndarray, cu_q: np.ndarray, kv_lens: np.ndarray, sparse_mode: int):
    """The documented sparse_indices rules of the sparse attention kernels: invalid entries are -1 and come after
    the valid ones, no entry is past its sequence's keys. -> [T, k] with the entries sparse_mode 3 hides set to -1."""
    invalid = indices < 0
    require(bool((indices[invalid] == -1).all()), op, "invalid sparse indices are -1")
    require(bool((np.cumsum(invalid, axis=1)[~invalid] == 0).all()), op, "each row must hold its valid indices first")
    seqs = ref.token_sequences(cu_q)
    require(bool((indices < kv_lens[seqs][:, None]).all()), op, "a sparse index is past its sequence's keys")
    return np.where(_causal_keep(indices, cu_q, kv_lens), indices, -1) if sparse_mode == 3 else indices


def npu_lightning_indexer(
    query: Tensor,
    key: Tensor,
    weights: Tensor,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    pre_tokens=MAX_INT64,
    next_tokens=MAX_INT64,
    return_value=False,
):
    """query TND [T, N1 <= 64, 128], key PA_BSND [blocks, block_size (multiple of 16, <= 1024), N2 = 1, 128],
    weights [T, N1]: all bf16/fp16 of one dtype and contiguous. sparse_count in 1..2048 or 3072..8192 step 1024;
    sparse_mode 3; return_value only off a paged key. -> (indices [T, 1, sparse_count] int32, best first, -1 tail;
    an empty values tensor)."""
    op = "npu_lightning_indexer"
    not_modeled(layout_query == "TND" and layout_key == "PA_BSND", op, f"layouts {layout_query}/{layout_key}")
    not_modeled(sparse_mode == 3, op, f"sparse_mode {sparse_mode}")
    require(pre_tokens == MAX_INT64 and next_tokens == MAX_INT64, op, "pre_tokens/next_tokens only take the default")
    require(not return_value, op, "return_value is only supported in training with a non-PA_BSND key layout")
    require(
        sparse_count in SPARSE_COUNTS, op, f"sparse_count must be 1..2048 or 3072..8192 step 1024, got {sparse_count}"
    )
    for name, t in (("query", query), ("key", key), ("weights", weights)):
        require(t.is_contiguous(), op, f"{name} must be contiguous")
        require(t.dtype in HALF_DTYPES, op, f"{name} must be bfloat16/float16, got {t.dtype}")
        require(t.dtype == query.dtype, op, "query, key and weights must share one dtype")
    require(query.dim() == 3 and query.shape[2] == 128, op, f"TND query must be [T, N1, 128], got {tuple(query.shape)}")
    num_tokens, heads, _ = query.shape
    require(heads <= 64, op, f"N1 must be <= 64, got {heads}")
    require(
        key.dim() == 4 and key.shape[2] == 1 and key.shape[3] == 128,
        op,
        f"PA_BSND key must be [blocks, bs, 1, 128], got {tuple(key.shape)}",
    )
    blocks, block_size = key.shape[:2]
    require(
        block_size % 16 == 0 and block_size <= 1024,
        op,
        f"block_size must be a multiple of 16 up to 1024, got {block_size}",
    )
    require(tuple(weights.shape) == (num_tokens, heads), op, f"weights must be [T, N1], got {tuple(weights.shape)}")
    cu_q = _prefix_sums(op, "actual_seq_lengths_query", actual_seq_lengths_query, num_tokens)
    batch = cu_q.size - 1
    kv_lens = _seq_lengths(op, "actual_seq_lengths_key", actual_seq_lengths_key, batch)
    require(bool((np.diff(cu_q) <= kv_lens).all()), op, "a sequence has more query tokens than keys")
    table = _block_table(op, block_table, kv_lens, block_size, blocks)

    indices, _ = ref.lightning_indexer(
        host(query), host(weights), host(key)[:, :, 0], table, kv_lens, cu_q, sparse_count
    )
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return device_tensor(indices.reshape(num_tokens, 1, sparse_count), torch.int32, query), empty


def _sfa_keys(op, key, key_rope, block_table, lengths_kv, layout_kv, batch):
    """-> (cache [blocks, bs, 576] float64, block table [B, max], kv lengths [B]) in the reference's paged form."""
    rows = np.concatenate([host(key), host(key_rope)], axis=-1)[..., 0, :]  # drop KV_N = 1
    if layout_kv == "PA_BSND":
        blocks, block_size = key.shape[:2]
        require(block_size % 16 == 0 and block_size <= 1024, op, "block_size must be a multiple of 16 up to 1024")
        kv_lens = _seq_lengths(op, "actual_seq_lengths_kv", lengths_kv, batch)
        return rows, _block_table(op, block_table, kv_lens, block_size, blocks), kv_lens
    cu_kv = _prefix_sums(op, "actual_seq_lengths_kv", lengths_kv, key.shape[0])
    require(cu_kv.size - 1 == batch, op, "actual_seq_lengths_kv must have one entry per query sequence")
    kv_lens = np.diff(cu_kv)
    # Packed keys as a paged cache of block size 1: sequence b's key p is row cu_kv[b] + p.
    table = np.zeros((batch, max(int(kv_lens.max(initial=0)), 1)), np.int64)
    for b in range(batch):
        table[b, : kv_lens[b]] = np.arange(cu_kv[b], cu_kv[b + 1])
    return rows[:, None, :], table, kv_lens


def npu_sparse_flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor | None,
    sparse_indices: Tensor,
    scale_value: float,
    *,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    query_rope=None,
    key_rope=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=MAX_INT64,
    next_tokens=MAX_INT64,
    attention_mode=0,
    return_softmax_lse=False,
    sinks=None,
):
    """attention_mode 2 (MLA-absorb, the only mode documented): query TND [T, N1 in {1..128 powers of 2}, 512],
    query_rope [T, N1, 64]; key = value (one tensor) [T2, 1, 512] (TND) or [blocks, bs, 1, 512] (PA_BSND),
    key_rope [.., 1, 64]; all bf16/fp16 of one dtype and contiguous; sparse_indices [T, 1, k] int32 with the valid
    entries first. return_softmax_lse is refused with PA_BSND (CANN rejects it). -> (out [T, N1, 512], softmax_max
    and softmax_sum [1, T, N1] fp32 or empty). A row without a valid index has an undefined output (poisoned)."""
    op = "npu_sparse_flash_attention"
    require(attention_mode == 2, op, f"attention_mode only takes 2 (MLA-absorb), got {attention_mode}")
    not_modeled(layout_query == "TND", op, f"layout_query {layout_query!r}")
    require(layout_kv in ("TND", "BSND", "PA_BSND"), op, f"bad layout_kv {layout_kv!r}")
    not_modeled(layout_kv in ("TND", "PA_BSND"), op, f"layout_kv {layout_kv!r}")
    require(
        not (return_softmax_lse and layout_kv == "PA_BSND"),
        op,
        "return_softmax_lse does not support a PA_BSND layout_kv",
    )
    not_modeled(sparse_mode in (0, 3), op, f"sparse_mode {sparse_mode}")
    not_modeled(sparse_block_size == 1, op, f"sparse_block_size {sparse_block_size}")
    not_modeled(sinks is None, op, "sinks")
    require(pre_tokens == MAX_INT64 and next_tokens == MAX_INT64, op, "pre_tokens/next_tokens only take the default")
    require(value is not None, op, "value=None needs CANN >= 9.2.0")
    require(query_rope is not None and key_rope is not None, op, "attention_mode 2 needs query_rope and key_rope")
    require(
        value.data_ptr() == key.data_ptr() and value.shape == key.shape and value.stride() == key.stride(),
        op,
        "in attention_mode 2 key and value share one tensor",
    )
    tensors = {"query": query, "key": key, "query_rope": query_rope, "key_rope": key_rope}
    for name, t in tensors.items():
        require(t.is_contiguous(), op, f"{name} must be contiguous")
        require(t.dtype in HALF_DTYPES and t.dtype == query.dtype, op, f"{name} must be bfloat16/float16 like query")
    require(
        sparse_indices.is_contiguous() and sparse_indices.dtype == torch.int32,
        op,
        "sparse_indices must be contiguous int32",
    )
    require(query.dim() == 3 and query.shape[2] == 512, op, f"query must be [T, N1, 512], got {tuple(query.shape)}")
    num_tokens, heads, _ = query.shape
    require(heads in SFA_QUERY_HEADS, op, f"N1 must be one of {SFA_QUERY_HEADS}, got {heads}")
    require(tuple(query_rope.shape) == (num_tokens, heads, 64), op, "query_rope must be [T, N1, 64]")
    require(
        key.shape[-2:] == (1, 512) and key_rope.shape[:-1] == key.shape[:-1] and key_rope.shape[-1] == 64,
        op,
        "key [.., 1, 512] and key_rope [.., 1, 64] must match",
    )
    require(
        sparse_indices.dim() == 3 and sparse_indices.shape[:2] == (num_tokens, 1) and sparse_indices.shape[2] > 0,
        op,
        f"sparse_indices must be [T, 1, sparse_size > 0], got {tuple(sparse_indices.shape)}",
    )
    cu_q = _prefix_sums(op, "actual_seq_lengths_query", actual_seq_lengths_query, num_tokens)
    batch = cu_q.size - 1
    cache, table, kv_lens = _sfa_keys(op, key, key_rope, block_table, actual_seq_lengths_kv, layout_kv, batch)
    require(bool((np.diff(cu_q) <= kv_lens).all()), op, "a sequence has more query tokens than keys")

    indices = _sparse_indices(op, host(sparse_indices)[:, 0, :], cu_q, kv_lens, sparse_mode)  # [T, k]
    seqs = ref.token_sequences(cu_q)

    q = np.concatenate([host(query), host(query_rope)], axis=-1)  # [T, N1, 576]
    out, lse = ref.sparse_flash_attention(q, cache, indices, table, kv_lens, cu_q, scale_value, 512)
    peak = np.full((num_tokens, heads), np.nan)
    for t in range(num_tokens):  # the row max the kernel reports alongside its sum
        keep = indices[t][indices[t] >= 0]
        if keep.size:
            keys = ref.gather_keys(cache, table, seqs[t], keep)
            peak[t] = (scale_value * (q[t] @ keys.T)).max(axis=1)
    empty = ~np.isfinite(lse)  # no valid key: the kernel's output is undefined
    out[empty] = np.nan
    attention_out = device_tensor(out, query.dtype, query)
    if not return_softmax_lse:
        none = torch.empty(0, dtype=torch.float32, device=query.device)
        return attention_out, none, none.clone()
    total = np.where(empty, np.nan, np.exp(lse - peak))
    return (
        attention_out,
        device_tensor(peak[None], torch.float32, query),
        device_tensor(total[None], torch.float32, query),
    )


KV_QUANT_ROW = 512 + 2 * 64 + 4 * 4  # int8 k_nope | k_rope in the query's dtype (bf16) | 4 fp32 per-tile scales


def _decode_kv_quant_rows(key: Tensor) -> np.ndarray:
    """[.., 656] int8 combined rows -> float64 [.., 576]: codes * their tile's scale, then the bf16 RoPE values."""
    data = key.detach().cpu().view(torch.uint8).numpy()
    codes = data[..., :512].view(np.int8).astype(np.float64)
    rope = np.ascontiguousarray(data[..., 512:640]).view("<u2").astype(np.uint32) << 16
    scales = np.ascontiguousarray(data[..., 640:656]).view("<f4").astype(np.float64)
    nope = (codes.reshape(*codes.shape[:-1], 4, 128) * scales[..., None]).reshape(codes.shape)
    return np.concatenate([nope, rope.view(np.float32).astype(np.float64)], axis=-1)


def npu_kv_quant_sparse_flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    sparse_indices: Tensor,
    scale_value: float,
    key_quant_mode: int,
    value_quant_mode: int,
    *,
    key_dequant_scale=None,
    value_dequant_scale=None,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=MAX_INT64,
    next_tokens=MAX_INT64,
    attention_mode=0,
    quant_scale_repo_mode=1,
    tile_size=128,
    rope_head_dim=64,
    key_dtype=None,
    value_dtype=None,
):
    """Per-tile int8 KV, MLA-absorb (attention_mode 2), scales combined with the data (quant_scale_repo_mode 1):
    query BSND [B, S, N, 576] bf16 = [q_nope | q_rope]; key = value int8 PA_BSND [blocks, bs (multiple of 16, <=
    1024), 1, 656] with rows [512 int8 | 64 bf16 RoPE | 4 fp32 scales of 128 codes each]; sparse_indices int32
    [B, S, 1, k], valid entries first, -1 after; block_table int32; actual_seq_lengths_kv [B] int32.
    key/value_dequant_scale are reserved (unsupported). -> out [B, S, N, 512] bf16; a row without a valid index
    has an undefined output (poisoned)."""
    op = "npu_kv_quant_sparse_flash_attention"
    require(attention_mode == 2, op, f"attention_mode only takes 2 (MLA-absorb), got {attention_mode}")
    require(key_quant_mode == 2 and value_quant_mode == 2, op, "key/value_quant_mode only take 2 (per-tile)")
    require(quant_scale_repo_mode == 1, op, "quant_scale_repo_mode only takes 1 (scales combined with the data)")
    require(tile_size == 128 and rope_head_dim == 64, op, f"tile_size 128 / rope_head_dim 64, got {tile_size}")
    require(key_dequant_scale is None and value_dequant_scale is None, op, "key/value_dequant_scale are reserved")
    require(key_dtype is None and value_dtype is None, op, "key_dtype/value_dtype are for other products")
    require(layout_kv == "PA_BSND", op, f"layout_kv only takes PA_BSND, got {layout_kv!r}")
    not_modeled(layout_query == "BSND", op, f"layout_query {layout_query!r}")
    not_modeled(sparse_mode in (0, 3), op, f"sparse_mode {sparse_mode}")
    not_modeled(sparse_block_size == 1, op, f"sparse_block_size {sparse_block_size}")
    require(pre_tokens == MAX_INT64 and next_tokens == MAX_INT64, op, "pre_tokens/next_tokens only take the default")
    require(query.dtype == torch.bfloat16 and query.is_contiguous(), op, "query must be contiguous bfloat16")
    require(query.dim() == 4 and query.shape[-1] == 576, op, f"query must be [B, S, N, 576], got {tuple(query.shape)}")
    batch, q_len, heads, _ = query.shape
    require(heads in SFA_QUERY_HEADS, op, f"N must be one of {SFA_QUERY_HEADS}, got {heads}")
    require(key.dtype == torch.int8 and key.is_contiguous(), op, "key must be contiguous int8")
    require(
        key.dim() == 4 and key.shape[2] == 1 and key.shape[3] == KV_QUANT_ROW,
        op,
        f"PA_BSND key must be [blocks, bs, 1, {KV_QUANT_ROW}], got {tuple(key.shape)}",
    )
    require(
        value.data_ptr() == key.data_ptr() and value.shape == key.shape,
        op,
        "in attention_mode 2 key and value share one tensor",
    )
    blocks, block_size = key.shape[:2]
    require(block_size % 16 == 0 and block_size <= 1024, op, "block_size must be a multiple of 16 up to 1024")
    require(
        sparse_indices.dtype == torch.int32 and sparse_indices.is_contiguous(), op, "sparse_indices: contiguous int32"
    )
    require(
        sparse_indices.dim() == 4 and sparse_indices.shape[:3] == (batch, q_len, 1) and sparse_indices.shape[3] > 0,
        op,
        f"sparse_indices must be [B, S, 1, sparse_size], got {tuple(sparse_indices.shape)}",
    )
    if actual_seq_lengths_query is not None:
        q_lens = host(actual_seq_lengths_query)
        require(tuple(q_lens.shape) == (batch,) and bool((q_lens == q_len).all()), op, "query lengths must be S")
    kv_lens = _seq_lengths(op, "actual_seq_lengths_kv", actual_seq_lengths_kv, batch)
    table = _block_table(op, block_table, kv_lens, block_size, blocks)

    cu_q = np.arange(batch + 1) * q_len
    indices = _sparse_indices(op, host(sparse_indices).reshape(batch * q_len, -1), cu_q, kv_lens, sparse_mode)
    cache = _decode_kv_quant_rows(key)[:, :, 0]  # [blocks, bs, 576]
    q = host(query).reshape(batch * q_len, heads, 576)
    out, lse = ref.sparse_flash_attention(q, cache, indices, table, kv_lens, cu_q, scale_value, 512)
    out[~np.isfinite(lse)] = np.nan  # no valid key: the kernel's output is undefined
    return device_tensor(out.reshape(batch, q_len, heads, 512), torch.bfloat16, query)
