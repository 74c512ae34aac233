"""Quantization ops: per-token int8 activations, W8A8 and W4A8 GEMMs, and the Hadamard transform.

The int8 / int4 ops take bf16/fp16/fp32 only: the float64 verification mode (docs/ops.md) does not extend to
them, because their integer codes and fp32 scales are the contract and a float64 variant would verify nothing
the quantized model computes. The Hadamard transform is a float op and accepts fp64 like the others.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_hal.checks import (
    ACTIVATION_DTYPES,
    FLOAT_OP_DTYPES,
    check,
    check_finite_float,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from glm5_hal.ops.common import call_op, custom_op, dispatch

# Last-dim sizes the Hadamard transform supports: K * 2^m for these K (QuaRot's set; the largest K wins).
HADAMARD_BASE_SIZES = (172, 156, 140, 108, 60, 52, 40, 36, 28, 20, 12, 1)


def _check_out_dtype(out_dtype: object) -> torch.dtype:
    check(
        out_dtype in ACTIVATION_DTYPES,
        TypeError,
        lambda: f"out_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {out_dtype!r}",
    )
    return out_dtype  # type: ignore[return-value]


def _check_int8_activations(x_q: Tensor, x_scale: Tensor, sizes: dict[str, int]) -> None:
    """x_q: [M, K] int8 with K >= 1 (dynamic_quant never makes an empty row, and a GEMM without a reduction dim
    is a caller bug); x_scale: [M] fp32."""
    check_tensor("x_q", x_q, ["M", "K"], (torch.int8,), sizes)
    check(sizes["K"] >= 1, ValueError, lambda: f"x_q: expected K >= 1 in [M, K], got shape {tuple(x_q.shape)}")
    check_tensor("x_scale", x_scale, ["M"], (torch.float32,), sizes)


@custom_op("dynamic_quant")
def _dynamic_quant_op(x: Tensor) -> tuple[Tensor, Tensor]:
    return dispatch("dynamic_quant", x.device, x)


@_dynamic_quant_op.register_fake
def _(x):
    # Outputs are new contiguous tensors whatever x's strides (docs/ops.md), so not empty_like.
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def dynamic_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token int8 quantization of activations.

    Args:
        x: [..., K], bf16/fp16/fp32 (not fp64: the float64 verification mode excludes the quantized ops).

    Returns:
        q: [..., K], int8. clamp(round_half_even(x / scale), -127, 127).
        scale: [...], fp32. max|x| / 127 per row; a zero row gets scale 1.

    Reference: ops_reference/quant.py
    """
    check(isinstance(x, Tensor), TypeError, lambda: f"x: expected a torch.Tensor, got {type(x).__name__}")
    check_tensor("x", x, [None] * max(x.dim(), 1), ACTIVATION_DTYPES)
    check(x.shape[-1] > 0, ValueError, lambda: f"x: expected a non-empty last dim, got shape {tuple(x.shape)}")
    return call_op(_dynamic_quant_op, x)


@custom_op("quant_matmul")
def _quant_matmul_op(
    x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    return dispatch("quant_matmul", x_q.device, x_q, x_scale, w_q, w_scale, bias, out_dtype)


@_quant_matmul_op.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    return x_q.new_empty(x_q.shape[0], w_q.shape[0], dtype=out_dtype)


def quant_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """W8A8 GEMM: int8 x int8 with an exact int32 accumulator, then the per-token and per-channel scales.

    Args:
        x_q: [M, K], int8. x_scale: [M], fp32. Activations from `dynamic_quant`.
        w_q: [N, K], int8. w_scale: [N], fp32. Per-output-channel symmetric weights.
        bias: [N], fp32 or out_dtype, or None.
        out_dtype: bf16, fp16 or fp32 (not fp64: the float64 verification mode excludes the quantized ops).

    Returns:
        y: [M, N], out_dtype. int32(x_q @ w_q^T) * x_scale[:, None] * w_scale[None, :] (+ bias). The int32
            accumulator is exact, so every backend agrees bit for bit before scaling.

    Reference: ops_reference/quant.py
    """
    sizes: dict[str, int] = {}
    _check_int8_activations(x_q, x_scale, sizes)
    check_tensor("w_q", w_q, ["N", "K"], (torch.int8,), sizes)
    check_tensor("w_scale", w_scale, ["N"], (torch.float32,), sizes)
    out_dtype = _check_out_dtype(out_dtype)
    check_optional_tensor("bias", bias, ["N"], (torch.float32, out_dtype), sizes)
    check_same_device(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale, bias=bias)
    return call_op(_quant_matmul_op, x_q, x_scale, w_q, w_scale, bias, out_dtype)


@custom_op("w4a8_matmul")
def _w4a8_matmul_op(
    x_q: Tensor, x_scale: Tensor, w_packed: Tensor, w_scale: Tensor, group_size: int | None, out_dtype: torch.dtype
) -> Tensor:
    return dispatch("w4a8_matmul", x_q.device, x_q, x_scale, w_packed, w_scale, group_size, out_dtype)


@_w4a8_matmul_op.register_fake
def _(x_q, x_scale, w_packed, w_scale, group_size, out_dtype):
    return x_q.new_empty(x_q.shape[0], w_packed.shape[0], dtype=out_dtype)


def w4a8_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_packed: Tensor,
    w_scale: Tensor,
    group_size: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """W4A8 GEMM: int8 activations x int4 weights packed two per byte.

    Args:
        x_q: [M, K], int8. x_scale: [M], fp32. Activations from `dynamic_quant`.
        w_packed: [N, K / 2], uint8. Symmetric int4 weights in [-8, 7], two's complement nibbles packed along K:
            even k in the low nibble, odd k in the high nibble.
        w_scale: [N] fp32 if group_size is None (per output channel), else [N, K / group_size] fp32.
        group_size: K-elements per weight scale (None = one scale per channel). Must divide K and be even.
        out_dtype: bf16, fp16 or fp32 (not fp64: the float64 verification mode excludes the quantized ops).

    Returns:
        y: [M, N], out_dtype. Each group accumulated exactly in int32, times its weight scale, summed, times
            x_scale.

    Reference: ops_reference/quant.py
    """
    sizes: dict[str, int] = {}
    _check_int8_activations(x_q, x_scale, sizes)
    k = sizes["K"]
    check(k % 2 == 0, ValueError, lambda: f"x_q: expected an even K (int4 weights pack two per byte), got K = {k}")
    check_tensor("w_packed", w_packed, ["N", k // 2], (torch.uint8,), sizes)
    if group_size is None:
        check_tensor("w_scale", w_scale, ["N"], (torch.float32,), sizes)
    else:
        check(
            isinstance(group_size, int) and not isinstance(group_size, bool),
            TypeError,
            lambda: f"group_size: expected None or an even divisor of K = {k}, got {group_size!r}",
        )
        check(
            group_size > 0 and group_size % 2 == 0 and k % group_size == 0,
            ValueError,
            lambda: f"group_size: expected None or an even divisor of K = {k}, got {group_size!r}",
        )
        check_tensor("w_scale", w_scale, ["N", k // group_size], (torch.float32,), sizes)
    out_dtype = _check_out_dtype(out_dtype)
    check_same_device(x_q=x_q, x_scale=x_scale, w_packed=w_packed, w_scale=w_scale)
    return call_op(_w4a8_matmul_op, x_q, x_scale, w_packed, w_scale, group_size, out_dtype)


def hadamard_base_size(n: int) -> int | None:
    """The K of n = K * 2^m used by `hadamard_transform` (largest supported K), or None if n is unsupported."""
    if n <= 0:
        return None
    for base in HADAMARD_BASE_SIZES:
        if n % base == 0 and (n // base) & (n // base - 1) == 0:
            return base
    return None


@custom_op("hadamard_transform")
def _hadamard_transform_op(x: Tensor, scale: float | None) -> Tensor:
    return dispatch("hadamard_transform", x.device, x, scale=scale)


@_hadamard_transform_op.register_fake
def _(x, scale):
    return x.new_empty(x.shape)


def hadamard_transform(x: Tensor, *, scale: float | None = None) -> Tensor:
    """Walsh-Hadamard transform over the last dim, for sizes n = K * 2^m (QuaRot's construction).

    Args:
        x: [..., n], bf16/fp16/fp32, or fp64 (verification mode, reference backend). n = K * 2^m with K in
            {1, 12, 20, 28, 36, 40, 52, 60, 108, 140, 156, 172} (6144 = 12 * 512, 7168 = 28 * 256); the largest
            such K is used.
        scale: multiplies the unnormalised transform; None = 1 / sqrt(n), which makes it orthonormal.

    Returns:
        y: [..., n], x's dtype. scale * x @ H^T with H = kron(H_K, H_{2^m}) (+-1 entries, Sylvester H_{2^m},
            K on the slow index). With the default scale, applying it again with H^T (H is symmetric for K = 1)
            gives x back.

    Reference: ops_reference/hadamard.py
    """
    check(isinstance(x, Tensor), TypeError, lambda: f"x: expected a torch.Tensor, got {type(x).__name__}")
    check_tensor("x", x, [None] * max(x.dim(), 1), FLOAT_OP_DTYPES)
    n = x.shape[-1]
    check(
        hadamard_base_size(n) is not None,
        ValueError,
        lambda: f"x: expected a last dim n = K * 2^m with K in {sorted(HADAMARD_BASE_SIZES)}, got n = {n}",
    )
    scale = None if scale is None else check_finite_float("scale", scale)
    return call_op(_hadamard_transform_op, x, scale)
