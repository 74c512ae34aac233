"""Fake vllm-kunlun quantization kernels: quant2d (per-row int8) and cutlass_scaled_mm (W8A8 GEMM).

quant2d(x, x_q, max, force_sdnn) writes codes and, per the wrapper's own note ("For quant2d ops, scale represents
max"), the row's max |x|, not the scale: callers divide by 127 themselves. Its rounding mode is not documented;
the fake rounds half to even (the contract's), and an all-zero row (max 0) gets undefined codes (poisoned).
cutlass_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias) follows vLLM's op of that name, whose layout vllm-kunlun's
caller keeps: b [K, N], scale_a [M, 1] or [1], scale_b [1, N] or [1], out = (a @ b) * scale_a * scale_b + bias, with
the bias in fp32 (kunlun_scale_mm.py passes it so) and a bf16 / fp16 output (vLLM asserts those two).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.kunlun.common import ACTIVATION_DTYPES, not_modeled, require, require_output
from fakes.schema_fake import INT8_POISON, device_tensor, host


def quant2d(x: Tensor, x_q: Tensor, max: Tensor, force_sdnn: bool = False) -> None:  # noqa: A002 (the schema's name)
    """x [rows, K] bf16/fp16 contiguous -> x_q [rows, K] int8 codes (round(x * 127 / max)), max [rows, 1] fp32."""
    op = "quant2d"
    not_modeled(force_sdnn, op, "force_sdnn=False (every vllm-kunlun caller passes True)")
    require(x.dim() == 2 and x.is_contiguous(), op, f"x must be 2-D and contiguous, got {tuple(x.shape)}")
    require(x.dtype in ACTIVATION_DTYPES, op, f"x must be bfloat16/float16 (the callers' activations), got {x.dtype}")
    rows = x.shape[0]
    require_output(op, "x_q", x_q, (tuple(x.shape),), torch.int8)
    require_output(op, "max", max, ((rows, 1),), torch.float32)
    values = host(x)
    codes, _ = ref.dynamic_quant(values)
    amax = np.abs(values).max(axis=-1, initial=0.0)
    codes = np.where((amax == 0)[:, None], INT8_POISON, codes)  # scale 0: the codes are undefined
    x_q.copy_(device_tensor(codes, torch.int8, x))
    max.copy_(device_tensor(amax[:, None], torch.float32, x))


def cutlass_scaled_mm(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype, bias: Tensor | None = None
) -> Tensor:
    """a [M, K] int8, b [K, N] int8 -> [M, N] out_dtype = (a @ b) * scale_a * scale_b (+ bias)."""
    op = "cutlass_scaled_mm"
    require(a.dtype == torch.int8 and b.dtype == torch.int8, op, f"a and b must be int8, got {a.dtype}/{b.dtype}")
    require(
        a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0],
        op,
        f"a [M, K] and b [K, N] must agree, got {tuple(a.shape)} and {tuple(b.shape)}",
    )
    not_modeled(out_dtype in ACTIVATION_DTYPES, op, f"out_dtype {out_dtype} (vLLM's op outputs bf16 / fp16)")
    m, n = a.shape[0], b.shape[1]
    require(
        scale_a.dtype == torch.float32 and tuple(scale_a.shape) in ((m, 1), (1,), (1, 1)),
        op,
        f"scale_a must be fp32 [M, 1] or [1], got {scale_a.dtype} {tuple(scale_a.shape)}",
    )
    require(
        scale_b.dtype == torch.float32 and tuple(scale_b.shape) in ((1, n), (1,), (1, 1)),
        op,
        f"scale_b must be fp32 [1, N] or [1], got {scale_b.dtype} {tuple(scale_b.shape)}",
    )
    if bias is not None:
        require(
            bias.dtype == torch.float32 and tuple(bias.shape) == (n,),
            op,
            f"bias must be fp32 [N] (kunlun_scale_mm.py), got {bias.dtype} {tuple(bias.shape)}",
        )
    y = (
        ref.int_matmul(host(a), host(b).T).astype(np.float64)
        * host(scale_a).reshape(-1, 1)
        * host(scale_b).reshape(1, -1)
    )
    if bias is not None:
        y = y + host(bias)[None, :]
    return device_tensor(y, out_dtype, a)
