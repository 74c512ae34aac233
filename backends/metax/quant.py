"""Quantization on MetaX: mcoplib's _C.dynamic_scaled_int8_quant and _C.cutlass_scaled_mm (vLLM's ops).

dynamic_quant:  dynamic_scaled_int8_quant(result!, x [M, K] contiguous, scale! [M, 1] fp32, azp None): symmetric
                per token, scale = max|x| * (1/127), codes = round-half-even(x * 127 / max|x|) clamped to
                [-127, 127]. Its max skips NaN (a `>` comparison), so a row's own max|x| (NaN, inf) replaces the
                kernel's scale where it is not finite; then the contract's zero-row / NaN rule
                (vendor_conventions.contract_quant_scale).
quant_matmul:   cutlass_scaled_mm(out! [M, N] bf16/fp16, x_q [M, K] row-major, w_q^T [K, N] column-major (a view),
                x_scale [M, 1], w_scale [1, N], bias [N] in the output dtype or None): the int32 accumulator scaled
                per token and per channel. Its 16-byte alignment checks need K and N multiples of 16; fp32 outputs
                run the portable path.
w4a8_matmul:    not mapped: vLLM-metax's cutlass_w4a8_mm takes fp8 (e4m3) activations with fp8 group scales (its
                test), which cannot hold the contract's int8 codes exactly (e4m3 has 3 mantissa bits), and its
                implementation is not in the repository.
"""

from __future__ import annotations

import torch

from backends.metax.runtime import kernel, portable
from glm5_hal.vendor_conventions import contract_quant_scale

LIBRARY = "mcoplib._C"
OUT_DTYPES = (torch.bfloat16, torch.float16)  # cutlass_scaled_mm's epilogue outputs
ALIGN = 16  # cutlass_scaled_mm: b.stride(1) % 16 == 0 and c.stride(0) % 16 == 0


def dynamic_quant(x):
    """glm5_hal.dynamic_quant with dynamic_scaled_int8_quant: x [..., K] -> (q int8 [..., K], scale fp32 [...])."""
    if x.numel() == 0:
        return portable("dynamic_quant", "empty input")(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    q = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    kernel(LIBRARY, "dynamic_scaled_int8_quant")(q, rows, scale, None)  # writes q and scale
    amax = rows.abs().amax(dim=-1).to(torch.float32)  # NaN for a row holding one, as the contract's scale
    scale = torch.where(torch.isfinite(amax), scale[:, 0], amax / 127)
    q, scale = contract_quant_scale(q, scale)
    return q.view(x.shape), scale.view(x.shape[:-1])


def quant_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    """glm5_hal.quant_matmul with cutlass_scaled_mm: x_q [M, K] int8, x_scale [M] fp32, w_q [N, K] int8,
    w_scale [N] fp32, bias [N] or None -> y [M, N] out_dtype = int32(x_q @ w_q^T) * x_scale * w_scale (+ bias)."""
    (m, k), n = x_q.shape, w_q.shape[0]
    reason = None
    if out_dtype not in OUT_DTYPES or k % ALIGN or n % ALIGN:
        reason = f"cutlass_scaled_mm outputs bf16/fp16 and takes K, N multiples of {ALIGN}"
    elif m == 0 or n == 0:  # an empty operand: the kernel's alignment and layout checks refuse a 0-wide one (N = 0)
        reason = "nothing to multiply"
    if reason is not None:
        return portable("quant_matmul", reason)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    kernel(LIBRARY, "cutlass_scaled_mm")(
        out,
        x_q.contiguous(),
        w_q.contiguous().t(),  # [K, N] column-major: the layout the kernel checks (b.stride(0) == 1)
        x_scale.to(torch.float32).reshape(m, 1).contiguous(),
        w_scale.to(torch.float32).reshape(1, n).contiguous(),
        None if bias is None else bias.to(out_dtype).contiguous(),
    )
    return out
