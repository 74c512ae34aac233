"""Float GEMMs of the Triton backend: the tile loop shared by the dense GEMMs (the prologs) and the grouped ones
(MoE), and the dense kernel.

Precision. Every backend accumulates in fp32, and the ops keep the intermediates between their GEMMs in fp32, as
the reference (float64) and the torch backend do: rounding one to a bf16 activation dtype costs 2^-9 of it, and
a short dot product or a norm's centring that cancels multiplies that (fused_moe at D = 1: 10% of the output;
mla_prolog at hidden 1, q_lora 10: 27% of q_lat; indexer_prolog's LayerNorm of nearly equal keys: 9%). So a GEMM
takes either
  - activations and weights of one dtype: native dots (bf16 / fp16 tensor cores on a GPU), fp32 accumulation; or
  - fp32 activations (an intermediate) and narrower weights: each activation tile is split in registers into
    hi + lo halves of the weights' dtype (`split_hi_lo`: hi + lo equals the fp32 value to ~2^-16 relative in
    bf16, ~2^-22 in fp16), and both halves meet the same weight tile: two native dots, one weight load.
and its output is fp32 (the next intermediate) or the activations' dtype (an op's output), rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.triton.gemm_tuning import float_shapes, launch_gemm
from backends.triton.quant import cast_for_store
from backends.triton.runtime import DOT_UPCAST, interpreting


@triton.jit
def split_hi_lo(a, dtype: tl.constexpr):
    """a (fp32) -> (hi, lo) in `dtype`: hi = a clamped to dtype's largest finite value, rounded; lo = the rest,
    rounded. The clamp keeps hi finite for every finite a (rounded to nearest, fp32 values within 0.4% of FLT_MAX
    became inf in bf16: an inf product, NaN through a zero weight; docs/ops.md "Edge rules"). An infinite a gives hi
    the largest value and lo the infinity, NaN both parts NaN: a split value propagates them as the unsplit one."""
    if dtype == tl.bfloat16:
        largest: tl.constexpr = 3.3895313892515355e38
    else:
        largest: tl.constexpr = 65504.0
    # Selects, not tl.minimum / tl.maximum: those may drop NaN (fmin on GPUs, nanmin in the interpreter).
    clamped = tl.where(a > largest, largest, tl.where(a < -largest, -largest, a))
    hi = cast_for_store(clamped, dtype)
    lo = cast_for_store(a - hi.to(tl.float32), dtype)
    return hi, lo


@triton.jit
def float_tile_matmul(
    x_ptr,  # activations; element (m, k) at x_ptr + m * stride_xm + k * stride_xk
    w_ptr,  # weights [N, K] of one matrix; element (n, k) at w_ptr + n * stride_wn + k * stride_wk
    rows,
    row_mask,
    cols,
    col_mask,
    k_end,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # the interpreter's bf16 dot is wrong: widen operands to fp32 there
    SPLIT: tl.constexpr,  # fp32 activations, narrower weights: two dots on the activations' hi + lo halves
):
    """-> fp32 [BLOCK_M, BLOCK_N] = x[rows, :k_end] @ w[cols, :k_end]^T with fp32 accumulation."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if SPLIT:
            a, a_lo = split_hi_lo(a, w_ptr.dtype.element_ty)
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # "ieee": fp32 operands must not be rounded to tf32 (fp32 parity is 1e-5); bf16/fp16 dots are unaffected.
        acc = tl.dot(a, b, acc, input_precision="ieee")
        if SPLIT:
            if DOT_UPCAST:
                a_lo = a_lo.to(tl.float32)
            acc = tl.dot(a_lo, b, acc, input_precision="ieee")
    return acc


def split_activations(x: Tensor, w: Tensor) -> bool:
    """Whether a GEMM of activations `x` with weights `w` splits x (fp32 x, narrower w); refuses other mixes."""
    if x.dtype == w.dtype:
        return False
    if x.dtype == torch.float32 and w.dtype in (torch.bfloat16, torch.float16):
        return True
    raise TypeError(f"triton GEMM: activations {x.dtype} with weights {w.dtype}; expected one dtype, or fp32 ones")


def interpreted_blocks(n: int, k: int) -> dict[str, int]:
    """BLOCK_N and BLOCK_K of a float GEMM under the interpreter, whose programs cost milliseconds of Python each:
    few, wide ones (on a GPU the autotuner picks them: backends/triton/gemm_tuning.py)."""
    return {"BLOCK_N": _interpreted_block(n), "BLOCK_K": _interpreted_block(k)}


def _interpreted_block(size: int) -> int:
    return min(512, max(16, triton.next_power_of_2(size)))


# ------------------------------------------------------------------------------------------------ dense GEMM
@triton.jit
def _matmul_kernel(
    # Pointers
    x_ptr,  # [B, M, K] activations (w's dtype, or fp32 with SPLIT)
    w_ptr,  # [B, N, K] weights
    y_ptr,  # [B, M, N], written (any float dtype)
    # Sizes
    M,
    N,
    K,
    # Strides (elements)
    stride_xb,
    stride_xm,
    stride_xk,
    stride_wb,
    stride_wn,
    stride_wk,
    stride_yb,
    stride_ym,
    stride_yn,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = float_tile_matmul(
        x_ptr + batch * stride_xb, w_ptr + batch * stride_wb, rows, row_mask, cols, col_mask, K,
        stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_UPCAST, SPLIT,
    )  # fmt: skip
    tl.store(
        y_ptr + batch * stride_yb + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        cast_for_store(acc, y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def batched_matmul_into(out: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """out[b] = x[b] @ w[b]^T for every b, fp32 accumulation, rounded once to out's dtype; returns out.

    x: [B, M, K] in w's dtype, or fp32 (an intermediate: split into hi + lo halves of w's dtype, see above).
    w: [B, N, K] bf16 / fp16 / fp32. out: [B, M, N] any float dtype, written. Any strides (views are read and
    written in place).
    """
    batches, num_rows, k = x.shape
    n = w.shape[1]
    if out.numel() == 0:
        return out
    block_m = max(16, min(128 if interpreting() else 64, triton.next_power_of_2(num_rows)))
    launch_gemm(
        _matmul_kernel,
        float_shapes(x.dtype == torch.float32),
        lambda block_n: (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n), batches),
        interpreted_blocks(n, k),
        x_ptr=x,
        w_ptr=w,
        y_ptr=out,
        M=num_rows,
        N=n,
        K=k,
        stride_xb=x.stride(0),
        stride_xm=x.stride(1),
        stride_xk=x.stride(2),
        stride_wb=w.stride(0),
        stride_wn=w.stride(1),
        stride_wk=w.stride(2),
        stride_yb=out.stride(0),
        stride_ym=out.stride(1),
        stride_yn=out.stride(2),
        BLOCK_M=block_m,
        DOT_UPCAST=DOT_UPCAST,
        SPLIT=split_activations(x, w),
    )
    return out


def linear(x: Tensor, w: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in out_dtype (default fp32: an intermediate kept unrounded)."""
    out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    batched_matmul_into(out[None], x[None], w[None])
    return out
