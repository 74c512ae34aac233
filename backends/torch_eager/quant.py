"""Quantization ops: per-token int8 quantization, and W8A8 / W4A8 GEMMs whose integer accumulators are exact.

Exactness without an integer GEMM: fp32 holds every integer of magnitude <= 2^24 exactly, and every partial sum of
a dot product of integers is itself an integer no larger than (columns x the largest product). So an fp32 GEMM
over at most 2^24 / max|product| columns is exact whatever order the library sums in (and so are its TF32 / bf16
fast modes, which keep int8 and int4 inputs exact and accumulate in fp32). Wider GEMMs run in such chunks, summed
in int32. That works on any device with an fp32 GEMM; `torch._int_mm` is used where it is the faster exact path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.torch_eager.primitives import COMPUTE_DTYPE, rows_per_tile

FP32_EXACT_INTEGER = 2**24
INT8_MAX_PRODUCT = 128 * 128  # int8 x int8, -128 included
INT4_MAX_PRODUCT = 128 * 8  # int8 activation x int4 weight
QMAX_INT8 = 127

# Devices where torch._int_mm is the fast exact path. Not the CPU: there it measured ~6x slower than the chunked
# fp32 path (M=64, K=7168, N=2048: 0.60 s vs 0.1 s on 2 cores, torch 2.13).
_INT_MM_DEVICE_TYPES = ("cuda",)


def dynamic_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token int8 (validated by glm5_hal.dynamic_quant).

    x: [..., K] bf16/fp16/fp32. Returns (q [..., K] int8 = clamp(round_half_even(x / scale), -127, 127),
    scale [...] fp32 = max|x| / 127, 1 for an all-zero row). A row holding NaN or inf gets scale NaN or inf and
    codes 0 (docs/ops.md "NaN").
    """
    x32 = x.to(COMPUTE_DTYPE).contiguous()  # the codes follow x32's layout; outputs are contiguous
    amax = x32.abs().amax(dim=-1)  # NaN if the row holds one
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / QMAX_INT8)
    # Divide (as the reference does) rather than multiply by 1 / scale: the reciprocal adds a second rounding that
    # moves x / scale across a .5 boundary more often. torch.round rounds half to even.
    codes = torch.round(x32 / scale[..., None]).clamp_(-QMAX_INT8, QMAX_INT8)
    q = codes.masked_fill_(~torch.isfinite(scale)[..., None], 0).to(torch.int8)
    return q, scale


def _int_mm_applies(a: Tensor, b: Tensor) -> bool:
    # cuBLAS int8 GEMM constraints checked by torch._int_mm on CUDA: M > 16, K and N multiples of 8.
    m, k = a.shape
    n = b.shape[0]
    return a.device.type in _INT_MM_DEVICE_TYPES and m > 16 and k % 8 == 0 and n % 8 == 0


def chunked_fp32_int_matmul(a: Tensor, b: Tensor, max_product: int) -> Tensor:
    """Exact a [M, K] @ b [N, K]^T of small integers (any integer dtype) -> [M, N] int32, by fp32 GEMMs over K
    chunks narrow enough to be exact (see the module docstring); max_product bounds |a[i, k] * b[j, k]|."""
    span = FP32_EXACT_INTEGER // max_product
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32, device=a.device)
    for k0 in range(0, a.shape[1], span):  # a loop over K chunks (7 at K = 7168), not over rows
        cols = slice(k0, k0 + span)
        acc += (a[:, cols].to(COMPUTE_DTYPE) @ b[:, cols].to(COMPUTE_DTYPE).T).to(torch.int32)
    return acc


def int8_matmul(a: Tensor, b: Tensor) -> Tensor:
    """Exact int8 a [M, K] @ int8 b [N, K]^T -> [M, N] int32 (bit-equal to int64 math while it fits int32)."""
    if _int_mm_applies(a, b):
        return torch._int_mm(a.contiguous(), b.contiguous().T)
    return chunked_fp32_int_matmul(a, b, INT8_MAX_PRODUCT)


def quant_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """W8A8 GEMM (validated by glm5_hal.quant_matmul).

    x_q: [M, K] int8; x_scale: [M] fp32; w_q: [N, K] int8; w_scale: [N] fp32; bias: [N] or None.
    Returns y [M, N] out_dtype = int32(x_q @ w_q^T) * x_scale[:, None] * w_scale[None, :] (+ bias), scaled in fp32.
    """
    y = int8_matmul(x_q, w_q).to(COMPUTE_DTYPE) * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        y = y + bias.to(COMPUTE_DTYPE)
    return y.to(out_dtype)


def unpack_int4(w_packed: Tensor) -> Tensor:
    """uint8 [N, K/2] -> int8 [N, K] in [-8, 7]: even k from the low nibble, odd k from the high one."""
    nibbles = torch.stack((w_packed & 0xF, w_packed >> 4), dim=-1).flatten(-2).to(torch.int8)  # [N, K] in 0..15
    return (nibbles ^ 8) - 8  # two's complement of 4 bits: 8..15 -> -8..-1


# Widest K span whose int8 x int4 dot products one fp32 GEMM sums exactly.
INT4_EXACT_SPAN = FP32_EXACT_INTEGER // INT4_MAX_PRODUCT


def _group_accumulators(x_q: Tensor, w_q: Tensor, w_groups: Tensor | None, group: int) -> Tensor:
    """[G, M, N] fp32: the exact integer accumulator of every group of `group` columns of K.

    x_q: [M, K] int8; w_q: [N, K] int8 codes; w_groups: w_q as fp32 [G, group, N] when group <= INT4_EXACT_SPAN
    (converted once per call by the caller), else None.
    """
    m, k = x_q.shape
    num_groups = k // group
    if w_groups is not None:
        # One batched fp32 GEMM over all groups, exact because each group is narrow enough.
        x_groups = x_q.reshape(m, num_groups, group).transpose(0, 1).to(COMPUTE_DTYPE)  # [G, M, g]
        return torch.bmm(x_groups, w_groups)
    # Groups wider than INT4_EXACT_SPAN columns (only a per-channel weight of huge K): int32, chunk by chunk.
    return torch.stack(
        [
            chunked_fp32_int_matmul(
                x_q[:, g * group : (g + 1) * group], w_q[:, g * group : (g + 1) * group], INT4_MAX_PRODUCT
            )
            for g in range(num_groups)
        ]
    ).to(COMPUTE_DTYPE)


def w4a8_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_packed: Tensor,
    w_scale: Tensor,
    group_size: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """W4A8 GEMM (validated by glm5_hal.w4a8_matmul).

    x_q: [M, K] int8; x_scale: [M] fp32; w_packed: [N, K/2] uint8 (int4 pairs, even k low nibble); w_scale: [N]
    fp32 (group_size None: per channel) or [N, K / group_size] fp32. Returns y [M, N] out_dtype: each group's
    exact integer accumulator times its weight scale, summed over groups, times x_scale (fp32).
    """
    w_q = unpack_int4(w_packed)  # [N, K]
    m, k = x_q.shape
    n = w_q.shape[0]
    group = k if group_size is None else group_size
    num_groups = k // group
    group_scales = w_scale.to(COMPUTE_DTYPE).reshape(n, num_groups).T  # [G, N]
    w_groups = None
    if group <= INT4_EXACT_SPAN:
        w_groups = w_q.view(n, num_groups, group).permute(1, 2, 0).to(COMPUTE_DTYPE)  # [G, g, N]
    y = torch.empty(m, n, dtype=COMPUTE_DTYPE, device=x_q.device)
    row_tile = rows_per_tile(num_groups * n)  # tiles of rows bound the [G, rows, N] accumulators
    for start in range(0, m, row_tile):
        rows = slice(start, start + row_tile)
        acc = _group_accumulators(x_q[rows], w_q, w_groups, group)  # [G, rows, N]
        y[rows] = (acc * group_scales[:, None, :]).sum(dim=0)
    return (y * x_scale[:, None]).to(out_dtype)
