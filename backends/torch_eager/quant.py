"""Quantization ops: per-token int8 quantization, and W8A8 / W4A8 GEMMs whose integer accumulators are exact.

Where backends.torch_eager.capabilities found an exact int8 GEMM that beats fp32 on the device
(backends.torch_eager.int8_gemms: oneDNN's u8 x s8 kernels on CPUs with VNNI / AMX, torch._int_mm on CUDA), the
accumulators come from it; what it derives from a weight (a prepacked copy, unpacked int4 codes) is made once per weight
(glm5_hal.weight_cache). Products with as few rows as the probe found glm5-hal's native VNNI kernel faster for (decode,
short prefill) run it instead: the weight in the kernel's panels (copied once per weight; W4A8 read at 4 bits), the
scaling fused, the same bits (backends.torch_eager.native.int8_gemm).
Otherwise, and with GLM5_HAL_FAST_PATHS=0, they come from the conservative path below.

Exactness without an integer GEMM: fp32 holds every integer of magnitude <= 2^24 exactly, and every partial sum of
a dot product of integers is itself an integer no larger than (columns x the largest product). So an fp32 GEMM
over at most 2^24 / max|product| columns is exact whatever order the library sums in (and so are its TF32 / bf16
fast modes, which keep int8 and int4 inputs exact and accumulate in fp32). Wider GEMMs run in such chunks, summed
in int32. That works on any device with an fp32 GEMM.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.torch_eager.capabilities import capabilities
from backends.torch_eager.int8_gemms import NATIVE_VNNI, Int8Gemm
from backends.torch_eager.native import int8_gemm
from backends.torch_eager.primitives import COMPUTE_DTYPE, rows_per_tile
from glm5_hal.weight_cache import derived

FP32_EXACT_INTEGER = 2**24
INT8_MAX_PRODUCT = 128 * 128  # int8 x int8, -128 included
INT4_MAX_PRODUCT = 128 * 8  # int8 activation x int4 weight
QMAX_INT8 = 127


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
    """Exact int8 a [M, K] @ int8 b [N, K]^T -> [M, N] int32 (bit-equal to int64 math while it fits int32), on the
    conservative path."""
    return chunked_fp32_int_matmul(a, b, INT8_MAX_PRODUCT)


def _takes_native(x_q: Tensor) -> bool:
    """Whether the probe chose glm5-hal's native int8 kernel for a product with x_q's rows
    (backends.torch_eager.native)."""
    device = x_q.device
    return device.type == "cpu" and capabilities(device).int8.takes_native(x_q.shape[0])


def _native_out(out_dtype: torch.dtype) -> torch.dtype:
    """What the native kernel writes for out_dtype: bf16 or fp32 directly, fp32 to be converted otherwise."""
    return out_dtype if out_dtype in int8_gemm.OUT_DTYPES else COMPUTE_DTYPE


def _fast_route(device: torch.device, m: int, k: int, n: int) -> Int8Gemm | None:
    """The probe's exact int8 GEMM for `device` if it takes [M, K] x [N, K]^T, else None (the conservative path)."""
    route = capabilities(device).int8_route()
    if route is None or not route.applies(m, k, n, device):
        return None
    return route


def _prepared(route: Int8Gemm, w_q: Tensor) -> object:
    """route.prepare(w_q), once per weight where preparing makes a copy (weight_cache)."""
    if not route.caches_weights:
        return route.prepare(w_q)
    return derived(w_q, route.name, route.prepare)


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
    if _takes_native(x_q):
        # One pass: the int8 weight read in place, scales, bias and the rounding to out_dtype in the kernel, in the
        # order of the lines below (the same bits).
        weight = derived(w_q, NATIVE_VNNI.name, NATIVE_VNNI.prepare)  # the weight in the kernel's panels, once
        bias32 = None if bias is None else bias.to(COMPUTE_DTYPE)
        # The kernel's wrapper, not its custom op: this op is the custom op callers trace (and a dispatch less).
        written = _native_out(out_dtype)
        y = int8_gemm.run_w8a8(x_q, weight, x_scale, w_scale, bias32, written)
        return y if written is out_dtype else y.to(out_dtype)  # a no-op .to still costs ~0.015 ms once evicted
    route = _fast_route(x_q.device, *x_q.shape, w_q.shape[0])
    if route is not None:
        acc = route.accumulate(x_q, _prepared(route, w_q))  # fp32 of the exact int32 accumulators
    else:
        acc = int8_matmul(x_q, w_q).to(COMPUTE_DTYPE)
    # acc is a new fp32 tensor on both paths (int8_gemms' contract): scale it in place (each pass over [M, N]
    # counts at decode sizes).
    y = acc.mul_(x_scale[:, None]).mul_(w_scale[None, :])
    if bias is not None:
        y.add_(bias.to(COMPUTE_DTYPE))
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


def _int4_groups_prepared(route: Int8Gemm, w_packed: Tensor, group: int) -> list[object]:
    """Unpack w_packed [N, K/2] once and prepare each group of `group` columns for `route` (cached per weight)."""

    def make(packed: Tensor) -> list[object]:
        codes = unpack_int4(packed)  # [N, K] int8, a fresh tensor: the cache entry must not reference the weight
        return [route.prepare(codes[:, g : g + group].contiguous()) for g in range(0, codes.shape[1], group)]

    return derived(w_packed, (route.name, "int4 groups", group), make)


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
    m, k = x_q.shape
    n = w_packed.shape[0]
    group = k if group_size is None else group_size
    num_groups = k // group
    if k and _takes_native(x_q) and int8_gemm.w4a8_takes(k, group):
        # The packed int4 weight read at 4 bits, nibbles split in registers; the torch route's arithmetic below.
        weight = derived(w_packed, (NATIVE_VNNI.name, "int4 panels"), int8_gemm.prepare_w4a8)  # once per weight
        written = _native_out(out_dtype)
        y = int8_gemm.run_w4a8(x_q, weight, w_scale.reshape(n, num_groups), x_scale, written)
        return y if written is out_dtype else y.to(out_dtype)
    group_scales = w_scale.to(COMPUTE_DTYPE).reshape(n, num_groups).T  # [G, N]
    route = _fast_route(x_q.device, m, group, n)
    if route is not None:
        # The exact int8 GEMM, one call per group, on codes unpacked once per weight; each group's accumulator is
        # scaled and summed as it comes, so no [G, M, N] stack exists.
        y = None
        for g, prepared in enumerate(_int4_groups_prepared(route, w_packed, group)):
            scaled = route.accumulate(x_q[:, g * group : (g + 1) * group], prepared).mul_(group_scales[g])
            y = scaled if y is None else y.add_(scaled)
        return y.mul_(x_scale[:, None]).to(out_dtype)

    w_q = unpack_int4(w_packed)  # [N, K]
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
