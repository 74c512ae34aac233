"""Fake torch_npu quantization kernels: npu_dynamic_quant, npu_quant_matmul, npu_convert_weight_to_int4pack,
npu_weight_quant_batchmatmul.

The int4 packing of npu_convert_weight_to_int4pack is documented only as "8 int4 per int32, interleaved"; the fake
uses its own interleaved order and npu_weight_quant_batchmatmul accepts int32 weights only if they came out of it,
so an adapter must go through the converter rather than pack the bits itself.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.ascend.common import (
    HALF_DTYPES,
    INT8_POISON,
    SCALAR_TYPES,
    device_tensor,
    host,
    is_transposed_2d,
    mark,
    marked,
    not_modeled,
    require,
)

MAX_INNER = 65535
# Position of logical element j (0..7) of each group of 8 inside the int32 word, nibble 0 = lowest bits.
INT4_NIBBLE_OF = (0, 2, 4, 6, 1, 3, 5, 7)


def npu_dynamic_quant(
    input: Tensor, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken", dst_type_max=0.0
):
    """input [..., K] fp16/bf16 with more than one dim. scale = rowmax|x| / 127 (fp32, shape input.shape[:-1]),
    y = round(x / scale) int8. An all-zero row has scale 0 and undefined codes (poisoned)."""
    op = "npu_dynamic_quant"
    not_modeled(smooth_scales is None and group_index is None, op, "smooth_scales / group_index")
    not_modeled(
        dst_type in (None, 1) and quant_mode == "pertoken" and dst_type_max == 0.0,
        op,
        "non-int8 or non-pertoken output",
    )
    require(input.dtype in HALF_DTYPES, op, f"x must be float16/bfloat16, got {input.dtype}")
    require(input.dim() > 1, op, f"x must have more than one dim, got {input.dim()}")
    x = host(input)
    q, scale = ref.dynamic_quant(x)
    zero = np.abs(x).max(axis=-1) == 0
    scale = np.where(zero, 0.0, scale)
    q = np.where(zero[..., None], INT8_POISON, q)
    return device_tensor(q, torch.int8, input), device_tensor(scale, torch.float32, input)


def npu_quant_matmul(
    x1: Tensor,
    x2: Tensor,
    scale: Tensor,
    *,
    offset=None,
    pertoken_scale=None,
    bias=None,
    output_dtype=None,
    x1_dtype=None,
    x2_dtype=None,
    pertoken_scale_dtype=None,
    scale_dtype=None,
    group_sizes=None,
    y_scale=None,
):
    """int8 x int8 rows of the A2/A3 dtype table: x1 [M, K] contiguous, x2 [K, N] (contiguous, transposed or
    FRACTAL_NZ), K <= 65535, scale [1] or [N]. bf16 out: scale fp32/bf16, pertoken_scale fp32 or None, bias
    int32/bf16/fp32; fp16 out: scale fp32 with pertoken_scale fp32, bias int32/fp16/fp32; int32 out: scale
    fp32/bf16, no pertoken_scale, bias int32. out = (x1 @ x2 [+ int32 bias]) * scale [* pertoken] [+ float bias]."""
    op = "npu_quant_matmul"
    not_modeled(offset is None and group_sizes is None and y_scale is None, op, "offset / group_sizes / y_scale")
    not_modeled(all(d is None for d in (x1_dtype, x2_dtype, pertoken_scale_dtype, scale_dtype)), op, "dtype overrides")
    require(
        x1.dtype == torch.int8 and x2.dtype == torch.int8,
        op,
        f"x1 and x2 must be int8 (int32 int4 not modeled), got {x1.dtype}/{x2.dtype}",
    )
    require(x1.dim() == 2 and x2.dim() == 2, op, "2-D x1 and x2 are modeled")
    require(x1.is_contiguous(), op, "x1 must be contiguous")
    require(x2.is_contiguous() or is_transposed_2d(x2), op, "x2 must be contiguous or a transposed contiguous tensor")
    (m, k), (k2, n) = x1.shape, x2.shape
    require(k == k2, op, f"x1 [M, K] and x2 [K, N] disagree on K: {k} vs {k2}")
    require(k <= MAX_INNER and n <= MAX_INNER, op, "the last dims of x1 and x2 must be <= 65535")
    out_dtype = SCALAR_TYPES.get(output_dtype if output_dtype is not None else 1)
    not_modeled(out_dtype in (torch.bfloat16, torch.float16, torch.int32), op, f"output_dtype {out_dtype}")
    require(scale.dim() == 1 and scale.shape[0] in (1, n), op, f"scale must be [1] or [N], got {tuple(scale.shape)}")
    allowed_scale = {
        torch.bfloat16: (torch.float32, torch.bfloat16),
        torch.float16: (torch.float32,),
        torch.int32: (torch.float32, torch.bfloat16),
    }
    require(scale.dtype in allowed_scale[out_dtype], op, f"scale {scale.dtype} does not go with output {out_dtype}")
    if out_dtype == torch.float16:
        require(pertoken_scale is not None, op, "a float16 output with a float scale needs pertoken_scale")
    if out_dtype == torch.int32:
        require(pertoken_scale is None, op, "an int32 output takes no pertoken_scale")
    if pertoken_scale is not None:
        require(
            pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,),
            op,
            "pertoken_scale must be [M] float32",
        )
    if bias is not None:
        allowed_bias = {
            torch.bfloat16: (torch.int32, torch.bfloat16, torch.float32),
            torch.float16: (torch.int32, torch.float16, torch.float32),
            torch.int32: (torch.int32,),
        }
        require(bias.dtype in allowed_bias[out_dtype], op, f"bias {bias.dtype} does not go with output {out_dtype}")
        require(tuple(bias.shape) in ((n,), (1, n)), op, f"bias must be [N] or [1, N], got {tuple(bias.shape)}")

    acc = ref.int_matmul(host(x1), host(x2).T).astype(np.float64)  # exact
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + host(bias).reshape(1, n)
    y = acc * host(scale).reshape(1, -1)
    if pertoken_scale is not None:
        y = y * host(pertoken_scale)[:, None]
    if bias is not None and bias.dtype != torch.int32:
        y = y + host(bias).reshape(1, n)
    return device_tensor(np.rint(y) if out_dtype == torch.int32 else y, out_dtype, x1)


def npu_convert_weight_to_int4pack(weight: Tensor, inner_k_tiles: int = 0) -> Tensor:
    """weight [rows, cols] int32, contiguous, values in [-8, 7], cols a multiple of 8 -> [rows, cols / 8] int32."""
    op = "npu_convert_weight_to_int4pack"
    require(
        weight.dtype == torch.int32 and weight.dim() == 2,
        op,
        f"weight must be 2-D int32, got {weight.dtype} {tuple(weight.shape)}",
    )
    require(weight.is_contiguous(), op, "weight must be contiguous")
    require(weight.shape[1] % 8 == 0, op, f"the last dim must be a multiple of 8, got {weight.shape[1]}")
    values = host(weight)
    require(bool(((values >= -8) & (values <= 7)).all()), op, "values must lie in the int4 range [-8, 7]")
    nibbles = (values & 0xF).reshape(values.shape[0], -1, 8)
    words = np.zeros(nibbles.shape[:2], np.int64)
    for j, position in enumerate(INT4_NIBBLE_OF):
        words |= nibbles[..., j] << (4 * position)
    words = np.where(words >= 2**31, words - 2**32, words)  # the int32 bit pattern
    return mark(device_tensor(words, torch.int32, weight), "int4pack", True)


def _unpack_int4(packed: np.ndarray) -> np.ndarray:
    words = packed.astype(np.int64) & 0xFFFFFFFF
    nibbles = np.stack([(words >> (4 * position)) & 0xF for position in INT4_NIBBLE_OF], axis=-1)
    values = np.where(nibbles >= 8, nibbles - 16, nibbles)
    return values.reshape(packed.shape[0], -1)


def npu_weight_quant_batchmatmul(
    x: Tensor,
    weight: Tensor,
    antiquant_scale: Tensor,
    antiquant_offset=None,
    quant_scale=None,
    quant_offset=None,
    bias=None,
    antiquant_group_size: int = 0,
    inner_precise: int = 0,
    weight_dtype=None,
) -> Tensor:
    """x [M, K] fp16/bf16; weight int8 [K, N], or int4 packed by npu_convert_weight_to_int4pack as (K, N/8) or the
    transposed view of (N, K/8); antiquant_scale in x's dtype: [1], [N], [1, N] (per channel) or
    [ceil(K / g), N] with g = antiquant_group_size a multiple of 32 in [32, K); K, N in [1, 65535].
    -> y [M, N] in x's dtype = x @ ((weight + antiquant_offset) * antiquant_scale)."""
    op = "npu_weight_quant_batchmatmul"
    not_modeled(quant_scale is None and quant_offset is None and bias is None, op, "quant_scale / quant_offset / bias")
    not_modeled(antiquant_offset is None and weight_dtype is None, op, "antiquant_offset / weight_dtype")
    require(inner_precise in (0, 1), op, "inner_precise must be 0 or 1")
    require(inner_precise == 0, op, "inner_precise 1 is only for FRACTAL_NZ int32 weights with M <= 16 per-group")
    require(
        x.dim() == 2 and x.dtype in HALF_DTYPES,
        op,
        f"x must be (M, K) float16/bfloat16, got {x.dtype} {tuple(x.shape)}",
    )
    require(x.is_contiguous() or is_transposed_2d(x), op, "x must be contiguous or transposed")
    m, k = x.shape
    if weight.dtype == torch.int32:
        require(marked(weight, "int4pack"), op, "int32 weights must come from torch_npu.npu_convert_weight_to_int4pack")
        if weight.is_contiguous():  # (K, N/8)
            require(weight.shape[0] == k, op, f"a (K, N/8) int4 weight must have K = {k} rows")
            w = _unpack_int4(host(weight))  # [K, N]
        else:
            require(
                is_transposed_2d(weight) and weight.shape[0] * 8 == k,
                op,
                "a transposed int4 weight must be (K/8, N) from (N, K/8)",
            )
            w = _unpack_int4(host(weight.t())).T  # [K, N]
    else:
        require(
            weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[0] == k,
            op,
            "weight must be int8 (K, N) or int4 packed",
        )
        w = host(weight)
    n = w.shape[1]
    require(1 <= k <= MAX_INNER and 1 <= n <= MAX_INNER, op, "K and N must lie in [1, 65535]")
    require(
        antiquant_scale.dtype == x.dtype,
        op,
        f"antiquant_scale must have x's dtype {x.dtype}, got {antiquant_scale.dtype}",
    )
    scale = host(antiquant_scale)
    if antiquant_group_size == 0:
        require(
            tuple(antiquant_scale.shape) in ((1,), (n,), (1, n)),
            op,
            f"per-channel antiquant_scale must be [N] or [1, N], got {tuple(antiquant_scale.shape)}",
        )
        w_deq = w * scale.reshape(1, -1)
    else:
        group = antiquant_group_size
        require(
            group % 32 == 0 and 32 <= group < k,
            op,
            f"antiquant_group_size must be a multiple of 32 in [32, K-1], got {group}",
        )
        groups = -(-k // group)
        require(tuple(antiquant_scale.shape) == (groups, n), op, f"per-group antiquant_scale must be ({groups}, {n})")
        w_deq = w * np.repeat(scale, group, axis=0)[:k]
    return device_tensor(host(x) @ w_deq, x.dtype, x)
