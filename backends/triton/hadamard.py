"""Hadamard transform of the Triton backend: y = scale * x @ kron(H_K, H_P)^T over the last dim n = K * P, P = 2^m.

One program per row, fp32 throughout. The row is held as a [K, P] tile (K on the slow index, as QuaRot builds
H = kron(H_K, H_P)); since kron(H_K, H_P) = (H_K kron I_P)(I_K kron H_P), the kernel
  1. mixes the K sub-rows with the small K x K matrix: acc[i, :] = sum_j H_K[i, j] * x[j*P : (j+1)*P]
     (K FMAs per element, one sub-row of x and one column of H_K per step, read straight from global memory;
     K = 1 is a copy). Written as 2-D multiply-adds on purpose: the earlier form, a [K, BLOCK_J, P] product summed
     over its middle axis, came out 8 / BLOCK_J times too large for BLOCK_J < 8 on an H200 with Triton 3.6
     (measured; the interpreter got it right), as if replicated lanes were summed;
  2. runs the m radix-2 butterfly stages of the fast Walsh-Hadamard transform along P in registers
     (O(n log n); each stage pairs p with p + h by a reshape / split / join, no shared-memory round trip
     written by hand),
  3. scales and stores.
H_K comes from ops_reference.hadamard.hadamard_matrix (the construction the reference defines), cached per
device as fp32.
Reference: ops_reference/hadamard.py
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.triton.quant import cast_for_store
from backends.triton.runtime import interpreting, unit_stride_arguments
from glm5_hal.ops.quant import hadamard_base_size


@triton.jit
def walsh_hadamard_rows(x, ROWS: tl.constexpr, P: tl.constexpr, LOG_P: tl.constexpr):
    """x [ROWS, P] fp32 -> x @ H_P^T for each row (Sylvester H_P, unnormalised), by LOG_P butterfly stages."""
    for stage in tl.static_range(LOG_P):
        # Stage with half-width h = 2^stage: view p = (block, t, r) with p = block * 2h + t * h + r, so the pair
        # (p, p + h) is (t = 0, t = 1); move t last, split it, butterfly, and undo the view.
        x = tl.reshape(x, (ROWS, P // (2 << stage), 2, 1 << stage))
        lo, hi = tl.split(tl.permute(x, (0, 1, 3, 2)))
        x = tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 3, 2))
        x = tl.reshape(x, (ROWS, P))
    return x


@triton.jit
def _hadamard_kernel(
    # Pointers
    x_ptr,  # [R, n] bf16/fp16/fp32
    h_base_ptr,  # [K, K] fp32, the +-1 base matrix H_K
    y_ptr,  # [R, n] x's dtype, written
    # Scalars
    scale,
    # Strides (elements)
    stride_xr,
    stride_xn,
    stride_yr,
    stride_yn,
    # Meta-parameters
    BASE: tl.constexpr,  # K
    BLOCK_BASE: tl.constexpr,  # next power of two >= K
    P: tl.constexpr,  # 2^m
    LOG_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_BASE)
    p = tl.arange(0, P)
    base_ok = i < BASE
    acc = tl.zeros((BLOCK_BASE, P), tl.float32)
    for j in range(0, BASE):  # sub-row j of x, weighted by column j of H_K, into every output sub-row
        h_col = tl.load(h_base_ptr + i * BASE + j, mask=base_ok, other=0.0)
        x_sub = tl.load(x_ptr + row * stride_xr + (j * P + p) * stride_xn)
        acc += h_col[:, None] * x_sub.to(tl.float32)[None, :]
    acc = walsh_hadamard_rows(acc, BLOCK_BASE, P, LOG_P) * scale
    tl.store(
        y_ptr + row * stride_yr + (i[:, None] * P + p[None, :]) * stride_yn,
        cast_for_store(acc, y_ptr.dtype.element_ty),
        mask=base_ok[:, None],
    )


@functools.cache
def _base_matrix(base: int, device: torch.device) -> Tensor:
    """H_K as fp32 on `device`, built once per (K, device)."""
    from ops_reference.hadamard import hadamard_matrix  # the construction is defined once, by the reference

    return torch.as_tensor(hadamard_matrix(base), dtype=torch.float32).to(device).contiguous()


@unit_stride_arguments()
def hadamard_transform(x: Tensor, *, scale: float | None = None) -> Tensor:
    """x [..., n] (bf16/fp16/fp32, n = K * 2^m) -> scale * x @ kron(H_K, H_{2^m})^T, x's dtype, fp32 math;
    scale None = 1 / sqrt(n) (orthonormal)."""
    n = x.shape[-1]
    base = hadamard_base_size(n)
    if base is None:  # the public op validated n; this guards direct callers
        raise ValueError(f"x: expected a last dim n = K * 2^m with a supported K, got n = {n}")
    pow2 = n // base
    rows = x.reshape(-1, n)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0:
        block_base = triton.next_power_of_2(base)
        # GPU: a row tile of BLOCK_BASE * P fp32, with more warps for big ones so each thread keeps <= ~64 values.
        num_warps = 4 if interpreting() else max(4, min(16, block_base * pow2 // 2048))
        _hadamard_kernel[(rows.shape[0],)](
            rows,
            _base_matrix(base, x.device),
            y,
            scale=1.0 / math.sqrt(n) if scale is None else float(scale),
            stride_xr=rows.stride(0),
            stride_xn=rows.stride(1),
            stride_yr=y.stride(0),
            stride_yn=y.stride(1),
            BASE=base,
            BLOCK_BASE=block_base,
            P=pow2,
            LOG_P=pow2.bit_length() - 1,
            num_warps=num_warps,
        )
    return y.reshape(x.shape)
