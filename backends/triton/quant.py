"""Quantization kernels of the Triton backend: per-token int8 activations, W8A8 and W4A8 GEMMs.

[dynamic_quant]  x [R, K] -> amax per row -> scale = amax / 127 -> q = clamp(rne(x / scale), +-127)
[quant_matmul]   int8 x int8 -> exact int32 tile -> * x_scale * w_scale (+ bias) -> out_dtype
[w4a8_matmul]    int8 x int4 (unpacked in registers) -> exact int32 per K-group -> * group scale, summed
                 in fp32 -> * x_scale -> out_dtype

The K loops (`int8_tile_matmul`, `w4a8_tile_matmul`) are jit helpers shared with the grouped (MoE) variants in
backends/triton/moe.py, so the integer arithmetic is written once.
Reference: ops_reference/quant.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.triton.gemm_tuning import launch_gemm
from backends.triton.runtime import interpreting, unit_stride_arguments

INT8_MAX = tl.constexpr(127.0)
# fp32 round-half-to-even of |y| < 2^22 without a libdevice call: adding 1.5 * 2^23 pushes the fraction out of
# the mantissa, and the add itself rounds to nearest even; subtracting it back is exact. Portable to every
# Triton target and the interpreter (libdevice.rint is CUDA/HIP specific).
_RNE_MAGIC = tl.constexpr(12582912.0)


# The interpreter converts fp32 to bf16 by truncation (round toward zero), doubling the rounding error of every
# bf16 store compared with a GPU (round to nearest even); interpreted kernels round explicitly instead.
_EMULATE_BF16_RNE = tl.constexpr(interpreting())


@triton.jit
def cast_for_store(x, dtype: tl.constexpr):
    """x (fp32) -> dtype, rounding to nearest even as GPU conversions do, also under the interpreter."""
    if _EMULATE_BF16_RNE and dtype == tl.bfloat16:
        # Round the 16 dropped mantissa bits to nearest even; the truncating conversion is then exact.
        # A NaN becomes the quiet NaN first: its payload may sit in the dropped bits (rounding would carry it into
        # the exponent, or truncation leave inf).
        x = tl.where(x != x, float("nan"), x.to(tl.float32))
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def round_half_even(y):
    """fp32 round-half-to-even, valid for |y| < 2^22 (codes here are within +-127)."""
    return (y + _RNE_MAGIC) - _RNE_MAGIC


# ---------------------------------------------------------------------------------------------- dynamic_quant
@triton.jit
def _dynamic_quant_kernel(
    # Pointers
    x_ptr,  # [R, K] bf16/fp16/fp32
    q_ptr,  # [R, K] int8, written
    scale_ptr,  # [R] fp32, written
    # Sizes
    num_rows,
    row_len,
    # Strides (elements)
    stride_x_row,
    stride_x_col,
    stride_q_row,
    stride_q_col,
    # Meta-parameters
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    # Pass 1: the row's largest magnitude, and whether it holds a NaN (counted apart: max reductions may skip NaN,
    # as GPU fmax and the interpreter's nanmax do).
    amax = tl.zeros([BLOCK_ROWS], tl.float32)
    nans = tl.zeros([BLOCK_ROWS], tl.int32)
    for k0 in range(0, row_len, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < row_len)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :] * stride_x_col, mask=mask, other=0.0)
        magnitude = tl.abs(x.to(tl.float32))
        is_nan = magnitude != magnitude
        nans += tl.sum(is_nan.to(tl.int32), axis=1)
        amax = tl.maximum(amax, tl.max(tl.where(is_nan, 0.0, magnitude), axis=1))
    amax = tl.where(nans > 0, float("nan"), amax)
    # A zero row keeps scale 1 (its codes are all 0); a row holding NaN or inf gets scale NaN or inf and codes 0.
    scale = tl.where(amax == 0.0, 1.0, amax / INT8_MAX)
    finite = amax < float("inf")  # False for NaN too
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    # Pass 2: the codes. A true division (not a reciprocal multiply) keeps x / scale within an ulp of exact.
    for k0 in range(0, row_len, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < row_len)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :] * stride_x_col, mask=mask, other=0.0)
        code = round_half_even(x.to(tl.float32) / scale[:, None])
        code = tl.where(finite[:, None], tl.minimum(tl.maximum(code, -INT8_MAX), INT8_MAX), 0.0)
        tl.store(q_ptr + rows[:, None] * stride_q_row + cols[None, :] * stride_q_col, code.to(tl.int8), mask=mask)


@unit_stride_arguments()
def dynamic_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token symmetric int8 of x [..., K] (bf16/fp16/fp32) -> (q int8 [..., K], scale fp32 [...])."""
    row_len = x.shape[-1]
    rows = x.reshape(-1, row_len)  # a view where x's layout allows; its strides go to the kernel
    q = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0] > 0:
        # Interpreted programs cost Python time each: fewer, larger ones there.
        block_rows = 16 if interpreting() else 4
        block_k = min(triton.next_power_of_2(row_len), 1024 if interpreting() else 2048)
        _dynamic_quant_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
            rows,
            q,
            scale,
            num_rows=rows.shape[0],
            row_len=row_len,
            stride_x_row=rows.stride(0),
            stride_x_col=rows.stride(1),
            stride_q_row=q.stride(0),
            stride_q_col=q.stride(1),
            BLOCK_ROWS=block_rows,
            BLOCK_K=block_k,
        )
    return q.reshape(x.shape), scale.reshape(x.shape[:-1])


# ----------------------------------------------------------------------------------- integer tile K loops
@triton.jit
def int8_tile_matmul(
    x_ptr,  # int8 activations; element (m, k) at x_ptr + m * stride_xm + k * stride_xk
    w_ptr,  # int8 weights [N, K] of one matrix; element (n, k) at w_ptr + n * stride_wn + k * stride_wk
    rows,  # [BLOCK_M] row indices, with row_mask
    row_mask,
    cols,  # [BLOCK_N] output-channel indices, with col_mask
    col_mask,
    k_end,  # K, or 0 for a tile that owns no rows (the loop then does nothing)
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """-> int32 [BLOCK_M, BLOCK_N] = x[rows, :k_end] @ w[cols, :k_end]^T, exact (int8 x int8 products, int32 sums)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0,
        )
        b = tl.load(
            w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0,
        )
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # an int32 accumulator must be named (Triton 3.6 asserts)
    return acc


@triton.jit
def unpack_int4_tile(packed, ks):
    """packed: [BLOCK_K, BLOCK_N] uint8, row i holding the byte of k = ks[i] (k // 2); -> int8 [BLOCK_K, BLOCK_N] in
    [-8, 7]: even k takes the low nibble, odd k the high one (two's complement nibbles)."""
    nibble = (packed.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 0xF
    return (nibble - ((nibble >> 3) << 4)).to(tl.int8)  # 8..15 -> -8..-1


@triton.jit
def w4a8_tile_matmul(
    x_ptr,  # int8 activations; element (m, k) at x_ptr + m * stride_xm + k * stride_xk
    w_ptr,  # uint8 packed weights [N, K/2] of one matrix; byte (n, k // 2) at w_ptr + n * stride_wn + k//2 * stride_wk
    w_scale_ptr,  # fp32 scales [N, K / group_size] of that matrix; (n, g) at + n * stride_sn + g * stride_sg
    rows,
    row_mask,
    cols,
    col_mask,
    k_end,  # K, or 0 for a tile that owns no rows
    group_size,  # K-elements per weight scale (K itself for per-channel scales)
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sg,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """-> fp32 [BLOCK_M, BLOCK_N] = sum over K-groups g of int32(x[rows, g] @ w[cols, g]^T) * w_scale[cols, g]."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for g0 in range(0, k_end, group_size):
        group_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
        group_end = g0 + group_size
        # Groups need not be multiples of BLOCK_K: the mask ends each group's last tile.
        for k0 in range(g0, group_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < group_end
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0,
            )
            # Each byte is loaded for both of its k (the second load hits cache) and split by k's parity.
            packed = tl.load(
                w_ptr + (ks // 2)[:, None] * stride_wk + cols[None, :] * stride_wn,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0,
            )
            group_acc = tl.dot(a, unpack_int4_tile(packed, ks), group_acc, out_dtype=tl.int32)
        group_scale = tl.load(w_scale_ptr + cols * stride_sn + (g0 // group_size) * stride_sg, mask=col_mask, other=0.0)
        acc += group_acc.to(tl.float32) * group_scale[None, :]
    return acc


# ------------------------------------------------------------------------------------------- dense GEMMs
@triton.jit
def _quant_matmul_kernel(
    # Pointers
    x_ptr,  # [M, K] int8
    x_scale_ptr,  # [M] fp32
    w_ptr,  # [N, K] int8
    w_scale_ptr,  # [N] fp32
    bias_ptr,  # [N] fp32 or out dtype (unused unless HAS_BIAS)
    y_ptr,  # [M, N] out dtype, written
    # Sizes
    M,
    N,
    K,
    # Strides (elements)
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    # Meta-parameters
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = int8_tile_matmul(
        x_ptr, w_ptr, rows, row_mask, cols, col_mask, K, stride_xm, stride_xk, stride_wn, stride_wk,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        cast_for_store(y, y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _w4a8_matmul_kernel(
    # Pointers
    x_ptr,  # [M, K] int8
    x_scale_ptr,  # [M] fp32
    w_ptr,  # [N, K/2] uint8, two int4 per byte along K
    w_scale_ptr,  # [N, K / group_size] fp32
    y_ptr,  # [M, N] out dtype, written
    # Sizes
    M,
    N,
    K,
    group_size,
    # Strides (elements)
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sg,
    stride_ym,
    stride_yn,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = w4a8_tile_matmul(
        x_ptr, w_ptr, w_scale_ptr, rows, row_mask, cols, col_mask, K, group_size,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        cast_for_store(acc * x_scale[:, None], y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def int_block_m(m: int) -> int:
    """Rows per tile of the dense int8 GEMMs: smaller tiles for decode-sized M (on a GPU the autotuner picks the
    N and K tiles for each: backends/triton/gemm_tuning.py)."""
    if interpreting():
        return min(64, triton.next_power_of_2(max(m, 1)))
    return 16 if m <= 16 else 64 if m <= 64 else 128


def interpreted_int_blocks(n: int, k: int) -> dict[str, int]:
    """BLOCK_N and BLOCK_K of an int8 GEMM under the interpreter: tiles that cover the small test shapes in few
    programs."""
    return {
        "BLOCK_N": min(256, triton.next_power_of_2(max(n, 1))),
        "BLOCK_K": min(256, triton.next_power_of_2(max(k, 1))),
    }


@unit_stride_arguments()
def quant_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """W8A8: x_q [M, K] int8, x_scale [M] fp32, w_q [N, K] int8, w_scale [N] fp32, bias [N] or None -> y [M, N]
    out_dtype = int32(x_q @ w_q^T) * x_scale[:, None] * w_scale[None, :] (+ bias)."""
    (m, k), n = x_q.shape, w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    block_m = int_block_m(m)
    launch_gemm(
        _quant_matmul_kernel,
        "int8",
        lambda block_n: (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
        interpreted_int_blocks(n, k),
        x_ptr=x_q,
        x_scale_ptr=x_scale,
        w_ptr=w_q,
        w_scale_ptr=w_scale,
        bias_ptr=w_scale if bias is None else bias,  # a valid pointer the kernel never reads without HAS_BIAS
        y_ptr=y,
        M=m,
        N=n,
        K=k,
        stride_xm=x_q.stride(0),
        stride_xk=x_q.stride(1),
        stride_wn=w_q.stride(0),
        stride_wk=w_q.stride(1),
        stride_ym=y.stride(0),
        stride_yn=y.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
    )
    return y


@unit_stride_arguments()
def w4a8_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_packed: Tensor,
    w_scale: Tensor,
    group_size: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """W4A8: x_q [M, K] int8, x_scale [M] fp32, w_packed [N, K/2] uint8 (even k in the low nibble), w_scale [N]
    (group_size None) or [N, K / group_size] fp32 -> y [M, N] out_dtype; each K-group accumulated in int32."""
    (m, k), n = x_q.shape, w_packed.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    scales = w_scale.reshape(n, -1)  # per channel = one group of K
    block_m = int_block_m(m)
    launch_gemm(
        _w4a8_matmul_kernel,
        "int8",
        lambda block_n: (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
        interpreted_int_blocks(n, k if group_size is None else group_size),
        x_ptr=x_q,
        x_scale_ptr=x_scale,
        w_ptr=w_packed,
        w_scale_ptr=scales,
        y_ptr=y,
        M=m,
        N=n,
        K=k,
        group_size=k if group_size is None else group_size,
        stride_xm=x_q.stride(0),
        stride_xk=x_q.stride(1),
        stride_wn=w_packed.stride(0),
        stride_wk=w_packed.stride(1),
        stride_sn=scales.stride(0),
        stride_sg=scales.stride(1),
        stride_ym=y.stride(0),
        stride_yn=y.stride(1),
        BLOCK_M=block_m,
    )
    return y
