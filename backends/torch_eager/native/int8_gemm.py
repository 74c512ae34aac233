"""Exact int8 GEMMs for W8A8 and W4A8 on CPUs with AVX-512 VNNI (int8_gemm.c).

    acc = w8a8_mm(x_q, w_q)                     # x_q [M, K] int8, w_q [N, K] int8 -> [M, N] fp32(exact int32)
    y = w4a8_mm(x_q, w_packed, scales, group)   # w_packed [N, K/2] uint8 int4 pairs, scales [N, G] fp32
                                                #   -> [M, N] fp32: sum over groups of fp32(exact int32) x scale
    ok, why = availability()

    weight = prepare_w8a8(w_q)                  # once per weight: panels, their address, the C function
    y = run_w8a8(x_q, weight, x_scale, w_scale, bias, torch.bfloat16)  # per call, arguments already validated

Both kernels read the weight in panels of 64 columns (panel_weight / panel_int4_weight: a copy made once per weight,
as oneDNN's route reorders the weight into its blocked layout once, backends.torch_eager.int8_gemms); a weight passed as
stored is copied into panels on every call. W4A8 keeps the int4 codes at 4 bits in its panels and splits the nibbles in
registers, so it streams half the bytes of W8A8 (torch has no int4 x int8 GEMM; without this kernel the codes are
unpacked to int8 once per weight and read at 8 bits); the activations are read as they are. The integer sums are
exact (int8_gemm.c says how); the fused epilogues are the torch route's fp32 steps, in its order
(backends/torch_eager/quant.py), so both give the same bits.

The GEMMs are the custom ops torch.ops.glm5_hal.native_w8a8_mm / native_w4a8_mm, split over torch's intra-op thread
count by panels (a result does not depend on the split).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from backends.torch_eager.native import build
from backends.torch_eager.native import threads as threads_
from glm5_hal.checks import check
from glm5_hal.ops.common import plain_eager

FAST = "avx512_vnni"  # build.ISAS: the kernel the backend uses
PORTABLE = "portable"  # the same blocking with scalar arithmetic (tests, any CPU)
PANEL_COLUMNS = 64  # PC in int8_gemm.c: a thread's share of the columns is whole panels
LANE_BYTES = 4  # bytes of one column per kernel step: 4 int8 codes, or 8 int4 ones
INT8_STEP = 4  # columns of K per W8A8 step
INT4_STEP = 8  # columns of K per W4A8 step: a group of W4A8 scales must be whole steps
ROW_BLOCK = 6  # PR in int8_gemm.c: rows of X per block
INT8_K_BLOCK = 4096  # KP8 in int8_gemm.c: W8A8's K per block
INT4_K_BLOCK = 8192  # KP4 in int8_gemm.c: W4A8's K per block (within a group)
INT8_ZERO_POINT = 128  # w + 128: the unsigned byte the W8A8 kernel multiplies
INT4_ZERO_POINT = 8  # w + 8: the unsigned nibble the W4A8 kernel multiplies

_C_LONG, _C_INT, _PTR = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
_SHARE = [_C_LONG] * 2  # n_begin, n_end: a thread's share of the columns
_W8A8_ARGS = [_C_LONG, _C_LONG, _PTR, _C_LONG, _PTR, _C_LONG, _PTR, _PTR, _PTR, _PTR, _C_LONG, _C_INT, *_SHARE]
_W4A8_ARGS = [_C_LONG, _C_LONG, _C_LONG, _PTR, _C_LONG, _PTR, _C_LONG, _PTR, _C_LONG, _PTR, _PTR, _C_LONG, _C_INT]
_W4A8_ARGS += _SHARE
_W8A8, _W4A8 = "glm5_w8a8_gemm_nt", "glm5_w4a8_gemm_nt"  # the C functions
OUT_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels write (others: fp32, converted by the caller)


def availability(isa: str = FAST) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel built for `isa` here (built on first use)."""
    return build.availability("int8_gemm", isa)


def w4a8_takes(k: int, group: int) -> bool:
    """Whether w4a8_mm takes groups of `group` columns of K: one group (per channel), or whole kernel steps."""
    return group == k or group % INT4_STEP == 0


def _panels(lanes: Tensor, pad: int) -> Tensor:
    """lanes [N, S, 4] uint8 (S kernel steps of one column's 4 bytes each) -> [ceil(N / 64), S, 64, 4]: the columns
    in panels of 64, padded with `pad` (a zero weight), each panel one sequential stream (int8_gemm.c)."""
    n, steps, _ = lanes.shape
    panels = -(-n // PANEL_COLUMNS)
    padded = lanes.new_full((panels * PANEL_COLUMNS, steps, LANE_BYTES), pad)
    padded[:n] = lanes
    return padded.view(panels, PANEL_COLUMNS, steps, LANE_BYTES).transpose(1, 2).contiguous()


def panel_weight(w_q: Tensor) -> Tensor:
    """w_q [N, K] int8 -> the W8A8 kernel's weight, [ceil(N / 64), ceil(K / 4), 64, 4] uint8 w + 128: each panel of
    64 columns one stream of steps, a step a column's 4 consecutive k in one int32 lane, zero weights past N and K.
    Made once per weight (the backend caches it, as oneDNN's prepacked copy); the kernel reads it at the same bits as
    the weight as stored."""
    n, k = w_q.shape
    steps = -(-k // INT8_STEP)
    codes = w_q.new_zeros(n, steps * INT8_STEP)
    codes[:, :k] = w_q
    shifted = codes.view(torch.uint8) ^ INT8_ZERO_POINT  # w + 128, exactly (the top bit flipped)
    return _panels(shifted.view(n, steps, LANE_BYTES), INT8_ZERO_POINT)


def panel_int4_weight(w_packed: Tensor) -> Tensor:
    """w_packed [N, K/2] uint8 (int4 pairs, even k in the low nibble) -> the W4A8 kernel's weight,
    [ceil(N / 64), ceil(K / 8), 64, 4] uint8, made once per weight: a step holds a column's 8 consecutive k, byte b
    the nibbles w + 8 of k = 8s + b (low) and 8s + 4 + b (high), so that each half meets 4 consecutive activation
    bytes; zero weights past N and K."""
    n, half = w_packed.shape
    steps = -(-2 * half // INT4_STEP)
    shifted = w_packed.new_full((n, steps * INT4_STEP), INT4_ZERO_POINT)  # w + 8 (w = 0 past K)
    shifted[:, 0 : 2 * half : 2] = (w_packed & 0x0F) ^ INT4_ZERO_POINT  # two's complement nibble -> w + 8
    shifted[:, 1 : 2 * half : 2] = (w_packed >> 4) ^ INT4_ZERO_POINT
    octets = shifted.view(n, steps, 2, LANE_BYTES)
    return _panels(octets[:, :, 0] | (octets[:, :, 1] << 4), INT4_ZERO_POINT | INT4_ZERO_POINT << 4)


def _check_weight(name: str, w: Tensor, dtype: torch.dtype, rows: int, depth: int, step: int) -> None:
    """w: [rows, columns] of `dtype` as stored (columns = depth, or depth / 2 int4 pairs), or its panels (uint8
    [ceil(rows / 64), ceil(depth / step), 64, 4])."""
    if w.dim() == 4:
        _check_cpu(name, w, 4, torch.uint8)
        want = (-(-rows // PANEL_COLUMNS), -(-depth // step), PANEL_COLUMNS, LANE_BYTES)
    else:
        _check_cpu(name, w, 2, dtype)
        want = (rows, depth if dtype == torch.int8 else depth // 2)
    check(tuple(w.shape) == want, ValueError, lambda: f"{name}: expected {want}, got {tuple(w.shape)}")


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _address(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _unit_stride(vector: Tensor | None) -> Tensor | None:
    """The vector as the kernels read it, with unit stride (a strided view copied), None kept. The caller keeps the
    result alive while the kernel runs: a copy made inside an argument list would be freed before the call. (One
    vector per call, not a comprehension over several: each comprehension is a call of its own in Python 3.11.)"""
    return None if vector is None else _rows(vector)


def _contiguous(t: Tensor) -> Tensor:
    # is_contiguous() is a plain attribute query; contiguous() goes through torch's dispatcher even where it returns
    # t itself, which counts on a decode-sized call.
    return t if t.is_contiguous() else t.contiguous()


def _check_cpu(name: str, t: Tensor, dims: int, dtype: torch.dtype) -> None:
    check(t.dim() == dims, ValueError, lambda: f"{name}: expected {dims} dimensions, got shape {tuple(t.shape)}")
    check(t.dtype == dtype, TypeError, lambda: f"{name}: expected {dtype}, got {t.dtype}")
    check(t.device.type == "cpu", ValueError, lambda: f"{name}: expected a CPU tensor, got {t.device}")


def _check_vector(name: str, t: Tensor | None, length: int) -> None:
    if t is not None:
        _check_cpu(name, t, 1, torch.float32)
        check(t.shape[0] == length, ValueError, lambda: f"{name}: expected [{length}], got {tuple(t.shape)}")


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    check(out_dtype in OUT_DTYPES, TypeError, lambda: f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype}")


@dataclass(frozen=True)
class PanelWeight:
    """A weight in a kernel's panels with what every call reads of it, made once per weight (prepare_w8a8 /
    prepare_w4a8; the backend caches it): on a decode-sized product each tensor query and lookup a call skips saves
    ~3-15 us once a model's other layers have evicted the caches, against a kernel of ~0.13 ms (kv_a_proj)."""

    panels: Tensor  # contiguous [ceil(N / 64), steps, 64, 4] uint8 (panel_weight / panel_int4_weight)
    columns: int  # N: the weight's rows, the product's columns
    address: int  # panels.data_ptr()
    panel_stride: int  # panels.stride(0), in bytes
    kernel: ctypes._CFuncPtr  # the C function for this weight's format, built for the ISA it was prepared for


def _panel_weight(panels: Tensor, columns: int, kernel: str, isa: str) -> PanelWeight:
    panels = _contiguous(panels)
    argtypes = _W8A8_ARGS if kernel == _W8A8 else _W4A8_ARGS
    function = build.function("int8_gemm", isa, kernel, argtypes, ctypes.c_int)
    return PanelWeight(panels, columns, panels.data_ptr(), panels.stride(0), function)


def prepare_w8a8(w_q: Tensor) -> PanelWeight:
    """w_q [N, K] int8 -> what run_w8a8 takes: its panels (panel_weight) for the fast build (FAST)."""
    return _panel_weight(panel_weight(w_q), w_q.shape[0], _W8A8, FAST)


def prepare_w4a8(w_packed: Tensor) -> PanelWeight:
    """w_packed [N, K / 2] uint8 int4 pairs -> what run_w4a8 takes: its panels (panel_int4_weight), FAST build."""
    return _panel_weight(panel_int4_weight(w_packed), w_packed.shape[0], _W4A8, FAST)


def _call(weight: PanelWeight, args: tuple, rows: int, depth: int, threads: int | None) -> None:
    cols = weight.columns
    parts = threads_.thread_count(2 * rows * cols * depth, threads)
    if parts == 1:  # decode on one thread: called here, without the shares' closures (~0.015 ms once evicted)
        failed = weight.kernel(*args, 0, cols) != 0
    else:
        failed = threads_.failed_shares(weight.kernel, args, threads_.split(cols, parts, PANEL_COLUMNS))
    if failed:
        raise MemoryError(f"{weight.kernel.__name__}: no memory for its scratch ({rows} rows)")


def _w8a8(
    x_q: Tensor,
    weight: PanelWeight,
    x_scale: Tensor | None,
    w_scale: Tensor | None,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    threads: int | None,
) -> Tensor:
    x_q, x_scale, w_scale, bias = _rows(x_q), _unit_stride(x_scale), _unit_stride(w_scale), _unit_stride(bias)
    rows, depth = x_q.shape
    cols = weight.columns
    out = torch.empty(rows, cols, dtype=out_dtype)
    if not rows or not cols:
        return out
    args = (rows, depth, x_q.data_ptr(), x_q.stride(0), weight.address, weight.panel_stride)
    args += (_address(x_scale), _address(w_scale), _address(bias), out.data_ptr(), cols, out_dtype == torch.bfloat16)
    _call(weight, args, rows, depth, threads)
    return out


def _w8a8_weight(w_q: Tensor, cols: int, isa: str) -> PanelWeight:
    # A weight as stored is copied into panels on every call (callers that keep a weight prepare it once).
    return _panel_weight(panel_weight(w_q) if w_q.dim() == 2 else w_q, cols, _W8A8, isa)


def w8a8_mm(
    x_q: Tensor,
    w_q: Tensor,
    n: int | None = None,
    x_scale: Tensor | None = None,
    w_scale: Tensor | None = None,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    *,
    isa: str = FAST,
    threads: int | None = None,
) -> Tensor:
    """W8A8 on the CPU: x_q [M, K] int8 @ w_q [N, K]^T int8 (any strides: copied into panels on every call) or
    panel_weight(w_q) (copied once by the caller) -> [M, N] out_dtype (fp32 or bf16). n: w_q's rows (needed where w_q
    is in panels).

    Without scales: fp32(the exact int32 sums), equal to torch._int_mm(x_q, w_q.T).float() while the sums fit int32.
    With x_scale [M] and w_scale [N] fp32 (both or neither) and bias [N] fp32: the sums times x_scale, times w_scale,
    plus bias, each an fp32 rounding in that order, then rounded to out_dtype as torch rounds: the bits of
    backends/torch_eager/quant.py's int8 routes. isa: the build (build.ISAS; build.NativeUnavailable where it cannot
    run). threads: default torch's."""
    _check_cpu("x_q", x_q, 2, torch.int8)
    m, k = x_q.shape
    n = w_q.shape[0] if n is None else n
    _check_weight("w_q", w_q, torch.int8, n, k, INT8_STEP)
    check(
        (x_scale is None) == (w_scale is None),
        ValueError,
        lambda: "x_scale, w_scale: expected both or neither",
    )
    _check_vector("x_scale", x_scale, m)
    _check_vector("w_scale", w_scale, n)
    _check_vector("bias", bias, n)
    _check_out_dtype(out_dtype)
    # Compile and FakeTensor see the op; in plain eager mode nothing would, and its implementation runs directly.
    if isa == FAST and threads is None and not plain_eager((x_q, w_q)):
        return torch.ops.glm5_hal.native_w8a8_mm(x_q, w_q, n, x_scale, w_scale, bias, out_dtype)
    return _w8a8(x_q, _w8a8_weight(w_q, n, isa), x_scale, w_scale, bias, out_dtype, threads)


def _w4a8(
    x_q: Tensor,
    weight: PanelWeight,
    scales: Tensor,
    x_scale: Tensor | None,
    out_dtype: torch.dtype,
    threads: int | None,
) -> Tensor:
    x_q, scales, x_scale = _rows(x_q), _rows(scales), _unit_stride(x_scale)
    rows, depth = x_q.shape
    cols, groups = weight.columns, scales.shape[1]
    out = torch.empty(rows, cols, dtype=out_dtype)
    if not rows or not cols:
        return out
    args = (rows, depth, groups, x_q.data_ptr(), x_q.stride(0), weight.address, weight.panel_stride)
    args += (scales.data_ptr(), scales.stride(0), _address(x_scale), out.data_ptr(), cols, out_dtype == torch.bfloat16)
    _call(weight, args, rows, depth, threads)
    return out


def _w4a8_weight(w_packed: Tensor, cols: int, isa: str) -> PanelWeight:
    # As _w8a8_weight: a weight as stored is copied into panels on every call.
    return _panel_weight(panel_int4_weight(w_packed) if w_packed.dim() == 2 else w_packed, cols, _W4A8, isa)


def w4a8_mm(
    x_q: Tensor,
    w_packed: Tensor,
    scales: Tensor,
    group: int,
    x_scale: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    *,
    isa: str = FAST,
    threads: int | None = None,
) -> Tensor:
    """W4A8 on the CPU, the weight read at 4 bits.

    x_q: [M, K] int8, K even. w_packed: [N, K / 2] uint8, int4 in two's complement, even k in the low nibble (any
    strides; copied into panels on every call), or panel_int4_weight(w_packed) (copied once by the caller).
    scales: [N, G] fp32, G = K / group. group: columns per scale, K (per channel) or a multiple of 8 dividing K
    (w4a8_takes). x_scale: [M] fp32 or None.
    Returns [M, N] out_dtype (fp32 or bf16): the sum over g, in order, of fp32(exact int32 sum of group g) *
    scales[:, g] (an fp32 multiply, then an fp32 add), times x_scale if given, rounded as torch rounds."""
    _check_cpu("x_q", x_q, 2, torch.int8)
    _check_cpu("scales", scales, 2, torch.float32)
    m, k = x_q.shape
    n = scales.shape[0]
    check(k % 2 == 0, ValueError, lambda: f"x_q: expected an even K (two int4 per byte), got K = {k}")
    check(
        group > 0 and k % group == 0 and w4a8_takes(k, group),
        ValueError,
        lambda: f"group: expected K = {k} or a multiple of {INT4_STEP} dividing it, got {group}",
    )
    _check_weight("w_packed", w_packed, torch.uint8, n, k, INT4_STEP)
    check(
        tuple(scales.shape) == (n, k // group),
        ValueError,
        lambda: f"scales: expected [{n}, {k // group}], got {tuple(scales.shape)}",
    )
    _check_vector("x_scale", x_scale, m)
    _check_out_dtype(out_dtype)
    if isa == FAST and threads is None and not plain_eager((x_q, w_packed)):
        return torch.ops.glm5_hal.native_w4a8_mm(x_q, w_packed, scales, group, x_scale, out_dtype)
    return _w4a8(x_q, _w4a8_weight(w_packed, n, isa), scales, x_scale, out_dtype, threads)


def run_w8a8(
    x_q: Tensor,
    weight: PanelWeight,
    x_scale: Tensor | None,
    w_scale: Tensor | None,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """w8a8_mm on a prepared weight (prepare_w8a8) and arguments a validated op already checked (the backend),
    without the custom op's dispatch: at decode sizes each layer of Python costs a measurable share of the kernel's
    time."""
    return _w8a8(x_q, weight, x_scale, w_scale, bias, out_dtype, None)


def run_w4a8(
    x_q: Tensor, weight: PanelWeight, scales: Tensor, x_scale: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """w4a8_mm on a prepared weight (prepare_w4a8) and arguments a validated op already checked (the backend),
    without the custom op's dispatch. scales: [N, G] fp32 (G groups of K / G columns)."""
    return _w4a8(x_q, weight, scales, x_scale, out_dtype, None)


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define(
    "native_w8a8_mm(Tensor x_q, Tensor w_q, int n, Tensor? x_scale, Tensor? w_scale, Tensor? bias,"
    " ScalarType out_dtype) -> Tensor"
)
_LIBRARY.impl(
    "native_w8a8_mm",
    lambda x, w, n, xs, ws, b, dtype: _w8a8(x, _w8a8_weight(w, n, FAST), xs, ws, b, dtype, None),
    "CPU",
)
_LIBRARY.define(
    "native_w4a8_mm(Tensor x_q, Tensor w_packed, Tensor scales, int group, Tensor? x_scale, ScalarType out_dtype)"
    " -> Tensor"
)
_LIBRARY.impl(
    "native_w4a8_mm",
    lambda x, w, s, group, xs, dtype: _w4a8(x, _w4a8_weight(w, s.shape[0], FAST), s, xs, dtype, None),
    "CPU",
)


@torch.library.register_fake("glm5_hal::native_w8a8_mm")
def _fake_w8a8(x_q, w_q, n, x_scale, w_scale, bias, out_dtype):
    return x_q.new_empty(x_q.shape[0], n, dtype=out_dtype)


@torch.library.register_fake("glm5_hal::native_w4a8_mm")
def _fake_w4a8(x_q, w_packed, scales, group, x_scale, out_dtype):
    return x_q.new_empty(x_q.shape[0], scales.shape[0], dtype=out_dtype)
