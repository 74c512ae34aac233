"""Quantization on Ascend: npu_dynamic_quant, npu_quant_matmul (W8A8) and the int4 weight path for W4A8.

dynamic_quant:  npu_dynamic_quant(x) (bf16/fp16, 2-D or more) -> the contract's zero-row rule on top
quant_matmul:   npu_quant_matmul(x_q int8 [M,K], w_q^T int8 [K,N] in FRACTAL_NZ (prepared once),
                scale = w_scale, pertoken_scale = x_scale, bias, output_dtype bf16/fp16). No documented
                combination outputs fp32, so fp32 outputs run the portable path.
w4a8_matmul:    torch_npu 2.14 documents int4 weights with int4 activations (A4W4) or with fp16/bf16
                activations (npu_weight_quant_batchmatmul), not with int8 ones. int8 codes are exact in
                bf16/fp16 (|q| <= 127 < 2^8), so the W4A16 kernel computes the same products:
                y = npu_weight_quant_batchmatmul(x_q as bf16/fp16, int4 weight, antiquant_scale = w_scale)
                * x_scale. The int4 weight is our K-packed uint8 unpacked to int32 values and repacked by
                npu_convert_weight_to_int4pack, once per weight tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend.layouts import int4_values
from backends.ascend.runtime import ACL_FORMAT_FRACTAL_NZ, half_or_bf16, npu, portable
from glm5_hal.vendor_conventions import contract_quant_scale
from glm5_hal.weight_cache import derived

QUANT_MATMUL_OUT = (torch.bfloat16, torch.float16)
MAX_INNER = 65535  # npu_quant_matmul / npu_weight_quant_batchmatmul: K, N <= 65535


def dynamic_quant(x):
    """glm5_hal.dynamic_quant on torch_npu: x [..., K] -> (q int8 [..., K], scale fp32 [...])."""
    if not half_or_bf16(x) or x.dim() < 2 or x.numel() == 0:
        return portable("dynamic_quant", "npu_dynamic_quant takes non-empty bf16/fp16 tensors of 2 or more dims")(x)
    q, scale = npu().npu_dynamic_quant(x)
    return contract_quant_scale(q, scale.to(torch.float32))


def _nz_transposed(w_q: Tensor) -> Tensor:
    """[N, K] int8 -> [K, N] in FRACTAL_NZ, the layout torch_npu recommends for npu_quant_matmul's x2 on A2/A3."""
    return npu().npu_format_cast(w_q.t().contiguous(), ACL_FORMAT_FRACTAL_NZ)


def quant_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    """glm5_hal.quant_matmul on torch_npu: x_q [M, K] int8, x_scale [M], w_q [N, K] int8, w_scale [N], bias [N]
    -> y [M, N] out_dtype = int32(x_q @ w_q^T) * x_scale * w_scale (+ bias)."""
    if out_dtype not in QUANT_MATMUL_OUT or x_q.shape[1] > MAX_INNER or x_q.shape[0] == 0:
        reason = "npu_quant_matmul outputs bf16/fp16 (not fp32) and takes K <= 65535"
        return portable("quant_matmul", reason)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    return npu().npu_quant_matmul(
        x_q.contiguous(),
        derived(w_q, "quant_matmul.x2", _nz_transposed),
        w_scale.to(torch.float32),
        pertoken_scale=x_scale.to(torch.float32),
        bias=bias,
        output_dtype=out_dtype,
    )


def _int4_pack(w_packed: Tensor) -> Tensor:
    """[N, K/2] uint8 (contract packing) -> [N, K/8] int32 in torch_npu's own int4 packing."""
    return npu().npu_convert_weight_to_int4pack(int4_values(w_packed).contiguous())


def _antiquant_scale(w_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[N] -> [1, N] (per channel) or [N, K/g] -> [K/g, N] (per group), in the activation dtype."""
    return (w_scale.view(1, -1) if w_scale.dim() == 1 else w_scale.t()).to(dtype).contiguous()


def w4a8_unsupported(x_q: Tensor, w_packed: Tensor, group_size: int | None, out_dtype: torch.dtype) -> str | None:
    """Why the int4 weight path cannot take these inputs, or None if it can."""
    m, k = x_q.shape
    n = w_packed.shape[0]
    if out_dtype not in QUANT_MATMUL_OUT:
        return "npu_weight_quant_batchmatmul outputs the activation dtype (bf16/fp16), not fp32"
    if k % 8 or k > MAX_INNER or n > MAX_INNER or m == 0 or n == 0:
        return "npu_convert_weight_to_int4pack needs K a multiple of 8; K, N <= 65535 (and rows to multiply)"
    if k == 8 or n == 1:
        # The kernel tells its (K/8, N) transposed weight from a (K, N/8) one by the strides, and a view with a
        # dim of 1 is both.
        return "a packed int4 weight with K = 8 or N = 1 is ambiguous to npu_weight_quant_batchmatmul"
    if group_size is not None and (group_size % 32 or not 32 <= group_size < k):
        return (
            f"npu_weight_quant_batchmatmul takes per-group sizes that are multiples of 32 in [32, K), got {group_size}"
        )
    return None


def w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size=None, out_dtype=torch.bfloat16):
    """glm5_hal.w4a8_matmul on torch_npu: x_q [M, K] int8, x_scale [M], w_packed [N, K/2] uint8, w_scale [N] or
    [N, K/group_size] -> y [M, N] out_dtype."""
    unsupported = w4a8_unsupported(x_q, w_packed, group_size, out_dtype)
    if unsupported is not None:
        return portable("w4a8_matmul", unsupported)(x_q, x_scale, w_packed, w_scale, group_size, out_dtype)
    packed = derived(w_packed, "w4a8_matmul.int4pack", _int4_pack)  # [N, K/8]
    scale = derived(w_scale, ("w4a8_matmul.antiquant_scale", out_dtype), lambda s: _antiquant_scale(s, out_dtype))
    y = npu().npu_weight_quant_batchmatmul(
        x_q.to(out_dtype),  # exact: int8 codes are integers below 2^8
        packed.t(),  # (K/8, N) view of the (N, K/8) packing: the kernel's transposed-weight form
        scale,
        antiquant_group_size=0 if group_size is None else group_size,
    )
    return (y.to(torch.float32) * x_scale.to(torch.float32)[:, None]).to(out_dtype)
