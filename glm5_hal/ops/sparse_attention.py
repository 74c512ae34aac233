"""Sparse flash attention: DeepSeek Sparse Attention over the absorbed (MQA-mode) MLA latent cache."""

from __future__ import annotations

from torch import Tensor

from glm5_hal.checks import (
    FLOAT_OP_DTYPES,
    INDEX_DTYPES,
    accumulation_dtype,
    check,
    check_finite_float,
    check_index_range,
    check_same_device,
    check_tensor,
)
from glm5_hal.kv_formats import AUTO, LATENT, check_cache, dispatch_kwargs
from glm5_hal.ops.common import call_op, check_paged_batch, custom_op, dispatch


@custom_op("sparse_flash_attention")
def _sparse_flash_attention_op(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    sm_scale: float,
    d_v: int,
    kv_cache_dtype: str,
) -> tuple[Tensor, Tensor]:
    return dispatch(
        "sparse_flash_attention",
        q.device,
        q,
        kv_cache,
        indices,
        block_table,
        seq_lens_k,
        cu_seqlens_q,
        sm_scale,
        d_v,
        **dispatch_kwargs(kv_cache_dtype),
    )


@_sparse_flash_attention_op.register_fake
def _(q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v, kv_cache_dtype):
    num_tokens, num_heads, _ = q.shape
    return (
        q.new_empty(num_tokens, num_heads, d_v),
        q.new_empty(num_tokens, num_heads, dtype=accumulation_dtype(q.dtype)),
    )


def sparse_flash_attention(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    sm_scale: float,
    d_v: int = 512,
    *,
    kv_cache_dtype: str = AUTO,
) -> tuple[Tensor, Tensor]:
    """Attention of each query token over the top-k keys its indexer selected (absorbed MLA, one KV head).

    Args:
        q: [T, H, 576], bf16/fp16/fp32, or fp64 (verification mode, reference backend). Absorbed queries
            `cat([q_lat, q_pe], -1)` from `mla_prolog`.
        kv_cache: [num_blocks, block_size, 576], same dtype as q. Paged latent cache; K is the whole row,
            V its first `d_v` dims. With a quantized kv_cache_dtype: [num_blocks, block_size, row_bytes] uint8,
            read as the stored codes times their scales (and the bf16 RoPE dims).
        indices: [T, topk], int32. Request-local key positions of the selected keys (`lightning_indexer`);
            -1 and positions >= seq_lens_k[b] are invalid and ignored. Duplicates in a row are a caller error.
        block_table: [B, max_blocks], int32. Cache block of each block of keys of each sequence.
        seq_lens_k: [B], int32. Keys in each sequence's context, its new tokens included.
        cu_seqlens_q: [B+1], int32. Prefix sums of the new tokens per sequence; cu_seqlens_q[-1] == T.
        sm_scale: softmax scale (from the unabsorbed qk_head_dim: GLM-5 0.0625, DeepSeek-V3.2 0.135234).
        d_v: width of V, the leading dims of each cache row (512).
        kv_cache_dtype: "auto" (a float cache), "fp8_ds_mla" or "int8_mla" (glm5_hal.kv_formats).

    Returns:
        out: [T, H, d_v], q's dtype. softmax(sm_scale * q . K[idx]) @ V[idx] over the valid indices.
        lse: [T, H], fp32 (fp64 for fp64 q). Natural-log logsumexp of the scaled scores. A row with no valid
            index gives out = 0 and lse = -inf (the log of an empty sum, so split results merge correctly).

    Reference: ops_reference/sparse_attention.py
    """
    sizes: dict[str, int] = {}
    check_tensor("q", q, ["T", "H", "D"], FLOAT_OP_DTYPES, sizes)
    check_cache("kv_cache", kv_cache, kv_cache_dtype, LATENT, ["num_blocks", "block_size", "D"], q.dtype, sizes)
    check_tensor("indices", indices, ["T", "topk"], INDEX_DTYPES, sizes)
    check(
        isinstance(d_v, int) and not isinstance(d_v, bool),
        TypeError,
        lambda: f"d_v: expected an int in [1, {sizes['D']}] (the row width of kv_cache), got {d_v!r}",
    )
    check(
        0 < d_v <= sizes["D"],
        ValueError,
        lambda: f"d_v: expected an int in [1, {sizes['D']}] (the row width of kv_cache), got {d_v!r}",
    )
    sm_scale = check_finite_float("sm_scale", sm_scale, positive=True)
    check_same_device(q=q, kv_cache=kv_cache, indices=indices)
    check_paged_batch("kv_cache", kv_cache, block_table, seq_lens_k, cu_seqlens_q, sizes["T"], sizes)
    check_index_range("indices", indices, -1, 2**31 - 1, lambda: "-1 or a request-local key position")
    return call_op(
        _sparse_flash_attention_op,
        q,
        kv_cache,
        indices,
        block_table,
        seq_lens_k,
        cu_seqlens_q,
        sm_scale,
        d_v,
        kv_cache_dtype,
    )
