"""Quantization on Kunlunxin: quant2d (dynamic_quant) and cutlass_scaled_mm (quant_matmul).

dynamic_quant:  quant2d(x [rows, K] bf16/fp16, x_q, max, force_sdnn=True) writes the row's max |x| where the
                contract has the scale: scale = max / 127 here (what vllm-kunlun's callers do), then the contract's
                zero-row and NaN rules (glm5_hal.vendor_conventions.contract_quant_scale)
quant_matmul:   cutlass_scaled_mm(x_q [M, K], w_q^T [K, N] (contiguous, made once per weight), x_scale [M, 1],
                w_scale [1, N], out_dtype bf16/fp16, bias fp32 [N]); vLLM's op of that name outputs bf16 / fp16
                only, so fp32 outputs run the portable path. (vllm-kunlun's faster `_C.matmul` takes per-channel
                maxima; its convention is known from one caller only, so it is not used.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.kunlun.runtime import kernel, portable, unavailable
from glm5_hal.vendor_conventions import contract_quant_scale
from glm5_hal.weight_cache import derived

ACTIVATIONS = (torch.bfloat16, torch.float16)  # what every vllm-kunlun caller feeds these kernels
INT8_MAX = 127.0


def dynamic_quant_unsupported(x: Tensor) -> str | None:
    """Why quant2d cannot take x, or None if it can."""
    if unavailable():
        return unavailable()
    if x.dtype not in ACTIVATIONS:
        return f"quant2d takes bf16/fp16 activations, got {x.dtype}"
    if x.numel() == 0:
        return "no rows"
    return None


def dynamic_quant(x):
    """glm5_hal.dynamic_quant on Kunlunxin: x [..., K] -> (q int8 [..., K], scale fp32 [...])."""
    unsupported = dynamic_quant_unsupported(x)
    if unsupported is not None:
        return portable("dynamic_quant", unsupported)(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    q = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    row_max = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    kernel("quant2d")(rows, q, row_max, True)
    q, scale = contract_quant_scale(q, row_max[:, 0] / INT8_MAX)
    return q.view(x.shape), scale.view(x.shape[:-1])


def _b_operand(w_q: Tensor) -> Tensor:
    """[N, K] int8 -> [K, N] contiguous: the b the wrapper would otherwise copy on every call (b.contiguous())."""
    return w_q.t().contiguous()


def quant_matmul_unsupported(x_q: Tensor, out_dtype: torch.dtype) -> str | None:
    if unavailable():
        return unavailable()
    if out_dtype not in ACTIVATIONS:
        return f"cutlass_scaled_mm outputs bf16/fp16 (vLLM's op), not {out_dtype}"
    if x_q.shape[0] == 0 or x_q.shape[1] == 0:
        return "nothing to multiply"
    return None


def quant_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    """glm5_hal.quant_matmul on Kunlunxin: x_q [M, K] int8, x_scale [M], w_q [N, K] int8, w_scale [N], bias [N]
    -> y [M, N] out_dtype = int32(x_q @ w_q^T) * x_scale * w_scale (+ bias)."""
    unsupported = quant_matmul_unsupported(x_q, out_dtype)
    if unsupported is not None:
        return portable("quant_matmul", unsupported)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    return kernel("cutlass_scaled_mm")(
        x_q.contiguous(),
        derived(w_q, "kunlun.cutlass_scaled_mm.b", _b_operand),
        x_scale.to(torch.float32).view(-1, 1),
        w_scale.to(torch.float32).view(1, -1),
        out_dtype,
        None if bias is None else bias.to(torch.float32).contiguous(),  # vllm-kunlun passes the bias in fp32
    )
