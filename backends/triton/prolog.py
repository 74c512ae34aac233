"""MLA prolog and indexer prolog of the Triton backend.

The GEMMs are backends/triton/matmul.py's: native dots on the activations' dtype, fp32 results, and the fp32
intermediates (q_norm before q_b_proj, q_nope before the W_UK absorption) fed to the next GEMM as hi + lo halves
of the weights' dtype, so no intermediate is rounded to a bf16 / fp16 activation dtype (as in the reference and
the torch backend; rounding them cost up to 27% of q_lat where q_b_proj's dot products cancel). Everything
between and after them is one fused Triton kernel over rows, `_norm_rope_kernel`:

  row [W] --(RMSNorm or LayerNorm over dims [0, NORM_DIM), fp32 statistics)--> (RoPE on the pair dims of
  [ROPE_START, ROPE_START + 2 * HALF), interleaved or half-split) --> store to the output row, or to the paged
  cache slot of the row's token (slot -1: nothing written).

The prologs use it four times:
  mla_prolog      q_norm = RMSNorm(x @ w_dq^T)                              norm only
                  q_pe = RoPE(last rope dims of each head of q)             rope only, per (token, head) row
                  cache row = [RMSNorm(c_kv) | RoPE(k_pe)] -> kv_cache      norm + rope + cache write
  indexer_prolog  q_idx = RoPE(first rope dims of each head)                rope only, per (token, head) row
                  cache row = RoPE(LayerNorm(x @ w_ik^T)) -> index_k_cache   norm + rope + cache write
A quantized cache (kv_cache_dtype, glm5_hal.kv_formats): the cache rows go to an fp32 scratch [T, width] instead,
and backends/triton/quantized_cache.py quantizes them into the cache's uint8 rows at slot_mapping.
Reference: ops_reference/mla.py, ops_reference/indexer.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.triton.matmul import batched_matmul_into, linear
from backends.triton.quant import cast_for_store
from backends.triton.quantized_cache import finish_write, scratch_rows
from backends.triton.runtime import interpreting, unit_stride_arguments
from glm5_hal.kv_formats import AUTO

NORM_NONE = tl.constexpr(0)
NORM_RMS = tl.constexpr(1)
NORM_LAYER = tl.constexpr(2)


@triton.jit
def _normalize(v, dims, mean, rstd, weight_ptr, bias_ptr, NORM_DIM, NORM: tl.constexpr):
    """v [BLOCK_R, n] at row dims `dims` [n] -> normalized where dims < NORM_DIM with the rows' mean and rstd
    [BLOCK_R, 1] (scaled by weight, plus bias for LayerNorm); other dims pass through."""
    if NORM == NORM_NONE:
        return v
    in_norm = dims < NORM_DIM
    weight = tl.load(weight_ptr + dims, mask=in_norm, other=1.0).to(tl.float32)
    normed = (v - mean) * rstd * weight[None, :]
    if NORM == NORM_LAYER:
        normed += tl.load(bias_ptr + dims, mask=in_norm, other=0.0).to(tl.float32)[None, :]
    return tl.where(in_norm[None, :], normed, v)


@triton.jit
def _norm_rope_kernel(
    # Pointers
    x_ptr,  # [R, W] rows to transform (any float dtype)
    weight_ptr,  # [NORM_DIM] norm scale (gamma)
    bias_ptr,  # [NORM_DIM] LayerNorm bias (unused otherwise)
    cos_ptr,  # [T, HALF] fp32, row r uses token r // rows_per_token
    sin_ptr,  # [T, HALF] fp32
    out_ptr,  # output rows: row r, or the paged cache slot slot_mapping[r] when SCATTER
    slot_ptr,  # [R] int64 slot mapping (SCATTER only)
    # Sizes and scalars
    num_rows,  # R
    width,  # W
    norm_dim,  # NORM_DIM
    rope_start,  # first dim of the RoPE pairs
    rows_per_token,  # rows sharing one cos/sin row (heads per token)
    cache_block_size,  # slots per cache block (SCATTER only)
    eps,
    # Strides (elements)
    stride_xr,
    stride_xd,
    stride_cos,
    stride_sin,
    stride_or,  # output row stride; with SCATTER the cache's block stride
    stride_os,  # with SCATTER the cache's slot stride (rows need not be flat slots: blocks may have padding)
    stride_od,
    # Meta-parameters
    NORM: tl.constexpr,  # NORM_NONE, NORM_RMS or NORM_LAYER
    HALF: tl.constexpr,  # RoPE pairs (rope dims / 2); 0 = no RoPE
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i+1); else half-split (i, i + HALF)
    SCATTER: tl.constexpr,  # write to the paged cache slot of slot_mapping[r]
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_W: tl.constexpr,  # >= W
    BLOCK_HALF: tl.constexpr,  # >= HALF
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    if SCATTER:
        slots = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
        row_ok &= slots >= 0  # a padding token (slot -1) writes nothing
        slots = tl.maximum(slots, 0)
        o_rows = (
            out_ptr + (slots // cache_block_size)[:, None] * stride_or + (slots % cache_block_size)[:, None] * stride_os
        )
    else:
        o_rows = out_ptr + rows[:, None] * stride_or
    x_rows = x_ptr + rows[:, None] * stride_xr
    dims = tl.arange(0, BLOCK_W)

    mean = tl.zeros((BLOCK_R, 1), tl.float32)
    rstd = tl.full((BLOCK_R, 1), 1.0, tl.float32)
    if NORM != NORM_NONE:
        in_norm = row_ok[:, None] & (dims < norm_dim)[None, :]
        v = tl.load(x_rows + dims[None, :] * stride_xd, mask=in_norm, other=0.0).to(tl.float32)
        if NORM == NORM_LAYER:
            mean = tl.sum(v, axis=1, keep_dims=True) / norm_dim
            v = tl.where(in_norm, v - mean, 0.0)
        rstd = tl.math.rsqrt(tl.sum(v * v, axis=1, keep_dims=True) / norm_dim + eps)

    # Dims outside the RoPE pairs: normalized (where in the norm range) and stored.
    plain = (dims < width) & ((dims < rope_start) | (dims >= rope_start + 2 * HALF))
    mask = row_ok[:, None] & plain[None, :]
    v = tl.load(x_rows + dims[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    v = _normalize(v, dims, mean, rstd, weight_ptr, bias_ptr, norm_dim, NORM)
    tl.store(o_rows + dims[None, :] * stride_od, cast_for_store(v, out_ptr.dtype.element_ty), mask=mask)

    if HALF > 0:
        pair = tl.arange(0, BLOCK_HALF)
        if INTERLEAVED:
            dims_a = rope_start + 2 * pair
            dims_b = dims_a + 1
        else:
            dims_a = rope_start + pair
            dims_b = dims_a + HALF
        mask = row_ok[:, None] & (pair < HALF)[None, :]
        a = tl.load(x_rows + dims_a[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_rows + dims_b[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        a = _normalize(a, dims_a, mean, rstd, weight_ptr, bias_ptr, norm_dim, NORM)
        b = _normalize(b, dims_b, mean, rstd, weight_ptr, bias_ptr, norm_dim, NORM)
        tokens = rows[:, None] // rows_per_token
        cos = tl.load(cos_ptr + tokens * stride_cos + pair[None, :], mask=mask, other=1.0)
        sin = tl.load(sin_ptr + tokens * stride_sin + pair[None, :], mask=mask, other=0.0)
        rotated_a = cast_for_store(a * cos - b * sin, out_ptr.dtype.element_ty)
        rotated_b = cast_for_store(a * sin + b * cos, out_ptr.dtype.element_ty)
        tl.store(o_rows + dims_a[None, :] * stride_od, rotated_a, mask=mask)
        tl.store(o_rows + dims_b[None, :] * stride_od, rotated_b, mask=mask)


def norm_rope(
    x: Tensor,
    out: Tensor,
    *,
    norm: int = 0,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    norm_dim: int = 0,
    eps: float = 0.0,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    rope_start: int = 0,
    interleaved: bool = True,
    rows_per_token: int = 1,
    slot_mapping: Tensor | None = None,
) -> None:
    """Run `_norm_rope_kernel` over the rows of x.

    x: [R, W] (any strides). out: [R, W], or with slot_mapping [R] int64 a paged cache [num_blocks, block_size, W]
    (any strides) whose slot slot_mapping[r] receives row r (-1 = skip). norm: 0 none, 1 RMSNorm, 2 LayerNorm over
    dims [0, norm_dim) with weight [norm_dim] (and bias [norm_dim] for LayerNorm). cos, sin: [T, rope / 2] fp32
    with T = R / rows_per_token: RoPE on dims [rope_start, rope_start + rope), after the norm. Written in place.
    Vectors and the tables' rows are read with unit stride (the ops' wrappers see to that: unit_stride_arguments).
    """
    num_rows, width = x.shape
    if num_rows == 0:
        return
    if slot_mapping is not None:
        stride_or, stride_os, stride_od = out.stride()  # slot s: block s // block_size, offset s % block_size
    else:
        stride_or, stride_od = out.stride()
        stride_os = 0
    half = 0 if cos is None else cos.shape[1]
    dummy = x  # pointer arguments a configuration does not read
    # GPU: 4 rows per program (a row is at most a few KB; T or T * H rows still give many programs). Interpreted:
    # 16 rows per program, since there each program costs Python time whatever its size.
    block_r = 16 if interpreting() else 4
    _norm_rope_kernel[(triton.cdiv(num_rows, block_r),)](
        x,
        dummy if weight is None else weight,
        dummy if bias is None else bias,
        dummy if cos is None else cos,
        dummy if sin is None else sin,
        out,
        dummy if slot_mapping is None else slot_mapping,
        num_rows=num_rows,
        width=width,
        norm_dim=norm_dim,
        rope_start=rope_start,
        rows_per_token=rows_per_token,
        cache_block_size=out.shape[1] if slot_mapping is not None else 1,
        eps=float(eps),
        stride_xr=x.stride(0),
        stride_xd=x.stride(1),
        stride_cos=0 if cos is None else cos.stride(0),
        stride_sin=0 if sin is None else sin.stride(0),
        stride_or=stride_or,
        stride_os=stride_os,
        stride_od=stride_od,
        NORM=norm,
        HALF=half,
        INTERLEAVED=interleaved,
        SCATTER=slot_mapping is not None,
        BLOCK_R=block_r,
        BLOCK_W=triton.next_power_of_2(width),
        BLOCK_HALF=max(1, triton.next_power_of_2(half)),
        num_warps=4,
    )


@unit_stride_arguments(written=("kv_cache",))
def mla_prolog(
    x: Tensor,
    w_dq: Tensor,
    gamma_cq: Tensor,
    w_uq_qr: Tensor,
    w_uk: Tensor,
    w_dkv_kr: Tensor,
    gamma_ckv: Tensor,
    cos: Tensor,
    sin: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    eps: float,
    kv_cache_dtype: str = AUTO,
) -> tuple[Tensor, Tensor, Tensor]:
    """Absorbed MLA queries and latent cache rows of T new tokens (arguments validated by glm5_hal.mla_prolog).

    x: [T, hidden]. w_dq: [q_lora, hidden]. gamma_cq: [q_lora]. w_uq_qr: [H * (nope + rope), q_lora], per head
    [q_nope | q_pe]. w_uk: [H, nope, kv_lora]. w_dkv_kr: [kv_lora + rope, hidden], rows [c_kv | k_pe].
    gamma_ckv: [kv_lora]. cos, sin: [T, rope / 2] fp32. kv_cache: [num_blocks, block_size, kv_lora + rope],
    written in place at slot_mapping [T] int64 (-1 = skip), or uint8 rows of a quantized kv_cache_dtype;
    interleaved RoPE.

    Returns (q_lat [T, H, kv_lora], q_pe [T, H, rope], q_norm [T, q_lora]), all in x's dtype.
    """
    num_tokens = x.shape[0]
    num_heads, nope, kv_lora = w_uk.shape
    rope_dim = 2 * cos.shape[1]

    q_norm = torch.empty((num_tokens, w_dq.shape[0]), dtype=torch.float32, device=x.device)  # fp32 until returned
    norm_rope(linear(x, w_dq), q_norm, norm=1, weight=gamma_cq, norm_dim=q_norm.shape[1], eps=eps)

    q = linear(q_norm, w_uq_qr).view(num_tokens * num_heads, nope + rope_dim)  # fp32, rows (token, head)
    q_pe = torch.empty((num_tokens, num_heads, rope_dim), dtype=x.dtype, device=x.device)
    norm_rope(q[:, nope:], q_pe.view(-1, rope_dim), cos=cos, sin=sin, rows_per_token=num_heads)
    # Absorb W_UK head by head as one batched GEMM: [H, T, nope] @ [H, nope, kv_lora] -> [H, T, kv_lora], written
    # through a head-major view of q_lat [T, H, kv_lora].
    q_nope = q.view(num_tokens, num_heads, nope + rope_dim)[..., :nope].transpose(0, 1)
    q_lat = torch.empty((num_tokens, num_heads, kv_lora), dtype=x.dtype, device=x.device)
    batched_matmul_into(q_lat.transpose(0, 1), q_nope, w_uk.transpose(1, 2))

    rows, slots = scratch_rows(kv_cache, slot_mapping, kv_cache_dtype, num_tokens, kv_lora + rope_dim, x.device)
    norm_rope(
        linear(x, w_dkv_kr),
        rows,
        norm=1,
        weight=gamma_ckv,
        norm_dim=kv_lora,
        eps=eps,
        cos=cos,
        sin=sin,
        rope_start=kv_lora,
        slot_mapping=slots,
    )
    finish_write(rows, kv_cache, slot_mapping, kv_cache_dtype)
    return q_lat, q_pe, q_norm.to(x.dtype)


@unit_stride_arguments(written=("index_k_cache",))
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
    """Indexer queries and head weights of T new tokens; writes their keys (validated by glm5_hal.indexer_prolog).

    x: [T, hidden]. q_norm: [T, q_lora]. w_iq: [HI * DI, q_lora]. w_ik: [DI, hidden]. k_norm_weight, k_norm_bias:
    [DI]. w_iw: [HI, hidden]. cos, sin: [T, rope / 2] fp32 (RoPE on the FIRST rope dims). index_k_cache:
    [num_blocks, block_size, DI], written in place at slot_mapping [T] int64 (-1 = skip), or uint8 rows of a
    quantized kv_cache_dtype.

    Returns (q_idx [T, HI, DI] in x's dtype, weights [T, HI] fp32 = (x @ w_iw^T) * HI^-0.5 * DI^-0.5).
    """
    num_tokens = x.shape[0]
    num_heads, head_dim = w_iw.shape[0], w_ik.shape[0]

    q = linear(q_norm, w_iq).view(num_tokens * num_heads, head_dim)  # fp32 until RoPE'd into q_idx
    q_idx = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    norm_rope(q, q_idx.view(-1, head_dim), cos=cos, sin=sin, interleaved=rope_interleaved, rows_per_token=num_heads)

    rows, slots = scratch_rows(index_k_cache, slot_mapping, kv_cache_dtype, num_tokens, head_dim, x.device)
    norm_rope(
        linear(x, w_ik),  # fp32: LayerNorm's centring would magnify a rounding of the keys
        rows,
        norm=2,
        weight=k_norm_weight,
        bias=k_norm_bias,
        norm_dim=head_dim,
        eps=eps,
        cos=cos,
        sin=sin,
        interleaved=rope_interleaved,
        slot_mapping=slots,
    )
    finish_write(rows, index_k_cache, slot_mapping, kv_cache_dtype)
    # The head weights stay fp32: they scale fp32 scores downstream.
    weights = linear(x, w_iw) * (num_heads**-0.5 * head_dim**-0.5)
    return q_idx, weights
