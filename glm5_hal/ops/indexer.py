"""Lightning indexer (DeepSeek Sparse Attention): its prolog, its score matrix and its top-k selection."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_hal.checks import (
    FLOAT_OP_DTYPES,
    accumulation_dtype,
    check,
    check_accumulation_tensor,
    check_finite_float,
    check_positive_int,
    check_same_device,
    check_tensor,
)
from glm5_hal.kv_formats import AUTO, INDEX, check_cache, dispatch_kwargs
from glm5_hal.ops.common import call_op, check_cache_write, check_paged_batch, custom_op, dispatch
from glm5_hal.ops.mla_prolog import check_rope_tables

# Largest `topk` lightning_indexer takes: 32x the models' 2048. It bounds the [T, topk] outputs, so that a typo
# (2**31) is an error instead of a 16 GiB allocation; topk above the visible keys is still fine (-1 padding).
MAX_TOPK = 65536


def _check_head_dim(index_k_cache: Tensor, sizes: dict[str, int]) -> None:
    check(
        sizes["DI"] >= 1,
        ValueError,
        lambda: f"index_k_cache: expected DI >= 1 in [num_blocks, block_size, DI], got {tuple(index_k_cache.shape)}",
    )


@custom_op("indexer_prolog", mutates_args=("index_k_cache",))
def _indexer_prolog_op(
    x: Tensor,
    q_norm: Tensor,
    w_iq: Tensor,
    w_ik: Tensor,
    k_norm_weight: Tensor,
    k_norm_bias: Tensor,
    w_iw: Tensor,
    cos: Tensor,
    sin: Tensor,
    index_k_cache: Tensor,
    slot_mapping: Tensor,
    rope_interleaved: bool,
    eps: float,
    kv_cache_dtype: str,
) -> tuple[Tensor, Tensor]:
    return dispatch(
        "indexer_prolog",
        x.device,
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
        rope_interleaved=rope_interleaved,
        eps=eps,
        **dispatch_kwargs(kv_cache_dtype),
    )


@_indexer_prolog_op.register_fake
def _(
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
    rope_interleaved,
    eps,
    kv_cache_dtype,
):
    head_dim = w_ik.shape[0]
    num_heads = w_iq.shape[0] // head_dim
    return (
        x.new_empty(x.shape[0], num_heads, head_dim),
        x.new_empty(x.shape[0], num_heads, dtype=accumulation_dtype(x.dtype)),
    )


def indexer_prolog(
    x: Tensor,
    q_norm: Tensor,
    w_iq: Tensor,
    w_ik: Tensor,
    k_norm_weight: Tensor,
    k_norm_bias: Tensor,
    w_iw: Tensor,
    cos: Tensor,
    sin: Tensor,
    index_k_cache: Tensor,
    slot_mapping: Tensor,
    *,
    rope_interleaved: bool,
    eps: float = 1e-6,
    kv_cache_dtype: str = AUTO,
) -> tuple[Tensor, Tensor]:
    """The indexer's queries and head weights for T new tokens; writes their index keys into the cache.

    Args:
        x: [T, hidden], bf16/fp16/fp32, or fp64 (verification mode, reference backend). The same normed hidden
            states `mla_prolog` takes.
        q_norm: [T, q_lora], x's dtype. The normed q latent returned by `mla_prolog`.
        w_iq: [HI * DI, q_lora]. indexer.wq_b. w_ik: [DI, hidden]. indexer.wk (one key shared by all heads).
        k_norm_weight, k_norm_bias: [DI]. indexer.k_norm (LayerNorm with bias, epsilon `eps`).
        w_iw: [HI, hidden]. indexer.weights_proj.
        cos, sin: [T, rope / 2], fp32 (fp64 for fp64 x). RoPE tables at each token's position; RoPE acts on
            the FIRST `rope` dims of each DI-wide query head and key (MLA puts it last).
        index_k_cache: [num_blocks, block_size, DI], x's dtype; or with a quantized kv_cache_dtype,
            [num_blocks, block_size, row_bytes] uint8 (glm5_hal.kv_formats). Written in place at `slot_mapping`.
        slot_mapping: [T], int64. Cache slot per token; -1 = do not write.
        rope_interleaved: pairs (x[2i], x[2i+1]) if True (GLM-5), (x[i], x[i + rope/2]) if False (DeepSeek-V3.2).
        eps: LayerNorm epsilon of k_norm (1e-6 for both models).
        kv_cache_dtype: "auto" (a float cache), "fp8_index" or "int8_index" (keys quantized on write: 128 codes
            and one fp32 scale; needs DI 128).

    Returns:
        q_idx: [T, HI, DI], x's dtype. RoPE(q_norm @ w_iq^T) per head.
        weights: [T, HI], fp32 (fp64 for fp64 x). (x @ w_iw^T) * HI^-0.5 * DI^-0.5.
        The key row of token t becomes RoPE(LayerNorm(x @ w_ik^T)).

    Reference: ops_reference/indexer.py
    """
    sizes: dict[str, int] = {}
    check_tensor("x", x, ["T", "hidden"], FLOAT_OP_DTYPES, sizes)
    dtype = x.dtype
    check_tensor("q_norm", q_norm, ["T", "q_lora"], (dtype,), sizes)
    check_cache("index_k_cache", index_k_cache, kv_cache_dtype, INDEX, [None, None, "DI"], dtype, sizes)
    _check_head_dim(index_k_cache, sizes)
    check_tensor("w_iq", w_iq, ["HI_x_DI", "q_lora"], (dtype,), sizes)
    check(
        sizes["HI_x_DI"] % sizes["DI"] == 0,
        ValueError,
        lambda: (
            f"w_iq: expected HI * DI rows with DI = {sizes['DI']} (index_k_cache's width), got {sizes['HI_x_DI']} rows"
        ),
    )
    num_heads = sizes["HI_x_DI"] // sizes["DI"]
    check_tensor("w_ik", w_ik, ["DI", "hidden"], (dtype,), sizes)
    check_tensor("k_norm_weight", k_norm_weight, ["DI"], (dtype,), sizes)
    check_tensor("k_norm_bias", k_norm_bias, ["DI"], (dtype,), sizes)
    check_tensor("w_iw", w_iw, [num_heads, "hidden"], (dtype,), sizes)
    rope = check_rope_tables(cos, sin, "T", dtype, sizes)
    check(
        rope <= sizes["DI"],
        ValueError,
        lambda: f"cos: expected rope width <= DI = {sizes['DI']}, got {rope}",
    )
    check_cache_write("index_k_cache", index_k_cache, slot_mapping, sizes["T"], sizes)
    check(
        isinstance(rope_interleaved, bool),
        TypeError,
        lambda: f"rope_interleaved: expected a bool, got {rope_interleaved!r}",
    )
    eps = check_finite_float("eps", eps, positive=True)
    check_same_device(
        x=x,
        q_norm=q_norm,
        w_iq=w_iq,
        w_ik=w_ik,
        k_norm_weight=k_norm_weight,
        k_norm_bias=k_norm_bias,
        w_iw=w_iw,
        cos=cos,
        sin=sin,
        index_k_cache=index_k_cache,
        slot_mapping=slot_mapping,
    )
    return call_op(
        _indexer_prolog_op,
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
        rope_interleaved,
        eps,
        kv_cache_dtype,
    )


def _check_scoring_inputs(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    kv_cache_dtype: str,
) -> dict[str, int]:
    sizes: dict[str, int] = {}
    check_tensor("q_idx", q_idx, ["T", "HI", "DI"], FLOAT_OP_DTYPES, sizes)
    check_accumulation_tensor("weights", weights, ["T", "HI"], q_idx.dtype, sizes)
    dims = ["num_blocks", "block_size", "DI"]
    check_cache("index_k_cache", index_k_cache, kv_cache_dtype, INDEX, dims, q_idx.dtype, sizes)
    _check_head_dim(index_k_cache, sizes)
    check_same_device(q_idx=q_idx, weights=weights, index_k_cache=index_k_cache)
    check_paged_batch("index_k_cache", index_k_cache, block_table, seq_lens_k, cu_seqlens_q, sizes["T"], sizes)
    return sizes


_SCORING_ARGS_DOC = """
        q_idx: [T, HI, DI], bf16/fp16/fp32, or fp64 (verification mode, reference backend). Indexer queries
            from `indexer_prolog`.
        weights: [T, HI], fp32 (fp64 for fp64 q_idx). Per-head weights from `indexer_prolog`.
        index_k_cache: [num_blocks, block_size, DI], q_idx's dtype. Paged index keys; or with a quantized
            kv_cache_dtype, [num_blocks, block_size, row_bytes] uint8, read as the stored codes times their scales.
        block_table: [B, max_blocks], int32. seq_lens_k: [B], int32. cu_seqlens_q: [B+1], int32.
            Query i of sequence b sits at position seq_lens_k[b] - q_len[b] + i and sees keys at positions <= it.
        kv_cache_dtype: "auto" (a float cache), "fp8_index" or "int8_index" (glm5_hal.kv_formats).
"""


@custom_op("indexer_logits")
def _indexer_logits_op(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    kv_cache_dtype: str,
) -> Tensor:
    return dispatch(
        "indexer_logits",
        q_idx.device,
        q_idx,
        weights,
        index_k_cache,
        block_table,
        seq_lens_k,
        cu_seqlens_q,
        **dispatch_kwargs(kv_cache_dtype),
    )


@_indexer_logits_op.register_fake
def _(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype):
    width = block_table.shape[1] * index_k_cache.shape[1]
    return q_idx.new_empty(q_idx.shape[0], width, dtype=accumulation_dtype(q_idx.dtype))


def indexer_logits(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    *,
    kv_cache_dtype: str = AUTO,
) -> Tensor:
    """The full indexer score matrix (what `lightning_indexer` ranks); for parity checks and debugging.

    Args:{args}
    Returns:
        logits: [T, max_blocks * block_size], fp32 (fp64 for fp64 q_idx).
            logits[t, s] = sum_j weights[t, j] * ReLU(q_idx[t, j] . k[s]) for visible key positions s of t's
            sequence, -inf elsewhere (the width is what the block table can address, so the shape does not
            depend on values).

    Reference: ops_reference/indexer.py
    """
    _check_scoring_inputs(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype)
    return call_op(
        _indexer_logits_op, q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype
    )


@custom_op("lightning_indexer")
def _lightning_indexer_op(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    topk: int,
    kv_cache_dtype: str,
) -> tuple[Tensor, Tensor]:
    return dispatch(
        "lightning_indexer",
        q_idx.device,
        q_idx,
        weights,
        index_k_cache,
        block_table,
        seq_lens_k,
        cu_seqlens_q,
        topk,
        **dispatch_kwargs(kv_cache_dtype),
    )


@_lightning_indexer_op.register_fake
def _(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, topk, kv_cache_dtype):
    num_tokens = q_idx.shape[0]
    return (
        q_idx.new_empty(num_tokens, topk, dtype=torch.int32),
        q_idx.new_empty(num_tokens, topk, dtype=accumulation_dtype(q_idx.dtype)),
    )


def lightning_indexer(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    topk: int,
    *,
    return_scores: bool = False,
    kv_cache_dtype: str = AUTO,
) -> Tensor | tuple[Tensor, Tensor]:
    """Pick, for every query token, the `topk` keys with the highest indexer score.

    Args:{args}        topk: keys to keep per token (2048 for both models), at most MAX_TOPK (65536). May exceed
            the visible keys.
        return_scores: also return the selected keys' scores.

    Returns:
        indices: [T, topk], int32. Request-local key positions of the row's top-`topk` scores, in any order;
            equal scores rank by the LOWER key position, so the set is the same on every call, backend and rank.
            When fewer than `topk` keys are visible, all of them come first and the rest is -1.
        scores (if return_scores): [T, topk], fp32 (fp64 for fp64 q_idx). The selected keys' scores; -inf
            where indices is -1.

    Reference: ops_reference/indexer.py
    """
    _check_scoring_inputs(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype)
    topk = check_positive_int("topk", topk, maximum=MAX_TOPK)
    indices, scores = call_op(
        _lightning_indexer_op,
        q_idx,
        weights,
        index_k_cache,
        block_table,
        seq_lens_k,
        cu_seqlens_q,
        topk,
        kv_cache_dtype,
    )
    return (indices, scores) if return_scores else indices


indexer_logits.__doc__ = indexer_logits.__doc__.format(args=_SCORING_ARGS_DOC)
lightning_indexer.__doc__ = lightning_indexer.__doc__.format(args=_SCORING_ARGS_DOC)
