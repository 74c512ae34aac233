"""Exact int8 GEMMs for W8A8 and W4A8 on CPUs with AVX-512 VNNI (int8_gemm.c).

    acc = w8a8_mm(x_q, w_q)                     # x_q [M, K] int8, w_q [N, K] int8 -> [M, N] fp32(exact int32)
    y = w4a8_mm(x_q, w_packed, scales, group)   # w_packed [N, K/2] uint8 int4 pairs, scales [N, G] fp32
                                                #   -> [M, N] fp32: sum over groups of fp32(exact int32) x scale
    ok, why = availability()

W8A8 reads the int8 rows as stored or, faster, tile_weight's copy (made once per weight, as oneDNN's route reorders
the weight into its blocked layout once, glm5_hal.int8_gemms). W4A8 reads tile_int4_weight's copy (a weight as
stored is repacked on every call) and splits the int4 nibbles in registers, so it streams half the bytes of W8A8
(torch has no int4 x int8 GEMM; without this kernel the codes are unpacked to int8 once per weight and read at 8
bits); the activations are read as they are. The integer sums are exact (int8_gemm.c says how); W4A8's fp32 steps
are the torch route's, in its order (backends/torch_eager/quant.py), so both give the same bits.

The GEMMs are the custom ops torch.ops.glm5_hal.native_w8a8_mm / native_w4a8_mm, split over torch's intra-op thread
count by columns (a result does not depend on the split).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from glm5_hal.checks import check
from glm5_hal.native import build
from glm5_hal.native import threads as threads_

FAST = "avx512_vnni"  # build.ISAS: the kernel the backend uses
PORTABLE = "portable"  # the same blocking with scalar arithmetic (tests, any CPU)
TILE_COLUMNS = 4  # NR in int8_gemm.c
STEP = 128  # KB in int8_gemm.c: W4A8 columns per step; a group of W4A8 scales must be whole steps
INT8_ZERO_POINT = 128  # w + 128: the unsigned byte the W8A8 kernel multiplies
INT4_ZERO_POINT = 8  # w + 8: the unsigned nibble the W4A8 kernel multiplies

_C_LONG, _C_INT, _PTR = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
_LAYOUT = [_C_LONG] * 3  # tile, lane, step (int8_gemm.c Layout)
_SHARE = [_C_LONG] * 2  # n_begin, n_end: a thread's share of the columns
_W8A8_ARGS = [_C_LONG, _C_LONG, _PTR, _C_LONG, _PTR, *_LAYOUT, _PTR, _C_LONG, _PTR, _PTR, _PTR, _PTR, _C_LONG, _C_INT]
_W8A8_ARGS += _SHARE
_W4A8_ARGS = [_C_LONG, _C_LONG, _C_LONG, _PTR, _C_LONG, _PTR, *_LAYOUT, _PTR, _C_LONG, _PTR, _PTR, _C_LONG, _C_INT]
_W4A8_ARGS += _SHARE
KC = 4096  # int8_gemm.c: W8A8's K per block
X_WHOLE = 256 * 1024  # int8_gemm.c: W8A8 takes K in one block where X has at most this many bytes
OUT_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels write (others: fp32, converted by the caller)


def availability(isa: str = FAST) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel built for `isa` here (built on first use)."""
    return build.availability("int8_gemm", isa)


def w4a8_takes(k: int, group: int) -> bool:
    """Whether w4a8_mm takes groups of `group` columns of K: whole kernel steps, or one group (per channel)."""
    return group == k or group % STEP == 0


CHUNK = 64  # bytes of a weight row per kernel step (int8_gemm.c Layout)


def tile_weight(w: Tensor) -> Tensor:
    """w [N, C] (int8 codes, or uint8 int4 pairs) -> [ceil(N / 4), ceil(C / 64), 4, 64]: each tile of 4 rows as one
    sequential stream of 64-byte chunks, zero-padded (int8_gemm.c Layout). Made once per weight (the backend caches
    it, as oneDNN's prepacked copy); the kernels read it at the same bits as the weight as stored."""
    n, c = w.shape
    tiles, chunks = -(-n // TILE_COLUMNS), -(-c // CHUNK)
    padded = w.new_zeros(tiles * TILE_COLUMNS, chunks * CHUNK)
    padded[:n, :c] = w
    return padded.view(tiles, TILE_COLUMNS, chunks, CHUNK).transpose(1, 2).contiguous()


def tile_int4_weight(w_packed: Tensor) -> Tensor:
    """w_packed [N, K/2] uint8 (int4 pairs, even k in the low nibble) -> the W4A8 kernel's weight, made once per
    weight: each block of 128 columns repacked so that its byte j holds columns j (low nibble) and 64 + j (high
    nibble), zero nibbles past K, then tile_weight's tiles. The kernel then multiplies 64 contiguous activations by
    each nibble half, with no per-call rearrangement of the activations."""
    n, half = w_packed.shape
    blocks = -(-half // CHUNK)  # 128 columns, 64 bytes each
    nibbles = w_packed.new_zeros(n, blocks * 2 * CHUNK)
    nibbles[:, 0 : 2 * half : 2] = w_packed & 0x0F
    nibbles[:, 1 : 2 * half : 2] = w_packed >> 4
    halves = nibbles.view(n, blocks, 2, CHUNK)
    return tile_weight((halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, blocks * CHUNK))


def _layout(w: Tensor) -> tuple[int, int, int]:
    """(tile, lane, step) of int8_gemm.c's Layout for a weight as stored [N, C] or tiled (tile_weight)."""
    if w.dim() == 4:
        return w.stride(0), CHUNK, TILE_COLUMNS * CHUNK
    return TILE_COLUMNS * w.stride(0), w.stride(0), CHUNK


def _check_weight(name: str, w: Tensor, dtype: torch.dtype, rows: int, columns: int) -> None:
    """w: [rows, columns] as stored, or tile_weight / tile_int4_weight of such a weight (the same shape)."""
    _check_cpu(name, w, w.dim() if w.dim() in (2, 4) else 2, dtype)
    want = (rows, columns)
    if w.dim() == 4:
        want = (-(-rows // TILE_COLUMNS), -(-columns // CHUNK), TILE_COLUMNS, CHUNK)
    check(tuple(w.shape) == want, ValueError, lambda: f"{name}: expected {want}, got {tuple(w.shape)}")


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _unit_stride(t: Tensor | None) -> Tensor | None:
    """A vector the kernels read with unit stride (a strided view copied), or None. The caller keeps the result
    alive while the kernel runs: a copy made inside an argument list would be freed before the call."""
    return None if t is None else _rows(t)


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


def _run(kernel: str, isa: str, argtypes: list, args: tuple, rows: int, cols: int, depth: int, threads: int | None):
    shares = threads_.split(cols, threads_.thread_count(2 * rows * cols * depth, threads), TILE_COLUMNS)
    failed = threads_.failed_shares(build.function("int8_gemm", isa, kernel, argtypes, ctypes.c_int), args, shares)
    check(not failed, MemoryError, lambda: f"{kernel}: no memory for its scratch ({rows} rows)")


def _w8a8(
    x_q: Tensor,
    w_q: Tensor,
    cols: int,
    x_scale: Tensor | None,
    w_scale: Tensor | None,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    isa: str,
    threads: int | None,
) -> Tensor:
    x_q, w_q = _rows(x_q), w_q.contiguous() if w_q.dim() == 4 else _rows(w_q)  # tiles: the layout is their strides
    x_scale, w_scale, bias = _unit_stride(x_scale), _unit_stride(w_scale), _unit_stride(bias)
    rows, depth = x_q.shape
    out = torch.empty(rows, cols, dtype=out_dtype)
    if out.numel() == 0:
        return out
    # int32 sums that outlive a K block: only where K takes several blocks (int8_gemm.c's kc_max).
    blocked = depth > KC and rows > TILE_COLUMNS and rows * depth > X_WHOLE
    acc = torch.empty(rows, cols, dtype=torch.int32) if blocked else None
    args = (rows, depth, x_q.data_ptr(), x_q.stride(0), w_q.data_ptr(), *_layout(w_q), _ptr(acc), cols)
    args += (_ptr(x_scale), _ptr(w_scale), _ptr(bias), out.data_ptr(), cols, int(out_dtype == torch.bfloat16))
    _run("glm5_w8a8_gemm_nt", isa, _W8A8_ARGS, args, rows, cols, depth, threads)
    return out


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
    """W8A8 on the CPU: x_q [M, K] int8 @ w_q [N, K]^T int8 (any strides, or tile_weight(w_q)) -> [M, N] out_dtype
    (fp32 or bf16). N: w_q's rows (needed where w_q is tiled).

    Without scales: fp32(the exact int32 sums), equal to torch._int_mm(x_q, w_q.T).float() while the sums fit int32.
    With x_scale [M] and w_scale [N] fp32 (both or neither) and bias [N] fp32: the sums times x_scale, times w_scale,
    plus bias, each an fp32 rounding in that order, then rounded to out_dtype as torch rounds: the bits of
    backends/torch_eager/quant.py's int8 routes. isa: the build (build.ISAS; build.NativeUnavailable where it cannot
    run). threads: default torch's."""
    _check_cpu("x_q", x_q, 2, torch.int8)
    m, k = x_q.shape
    n = w_q.shape[0] if n is None else n
    _check_weight("w_q", w_q, torch.int8, n, k)
    check(
        (x_scale is None) == (w_scale is None),
        ValueError,
        lambda: "x_scale, w_scale: expected both or neither",
    )
    _check_vector("x_scale", x_scale, m)
    _check_vector("w_scale", w_scale, n)
    _check_vector("bias", bias, n)
    _check_out_dtype(out_dtype)
    if isa == FAST and threads is None:
        return torch.ops.glm5_hal.native_w8a8_mm(x_q, w_q, n, x_scale, w_scale, bias, out_dtype)
    return _w8a8(x_q, w_q, n, x_scale, w_scale, bias, out_dtype, isa, threads)


def _w4a8(
    x_q: Tensor,
    w_packed: Tensor,
    scales: Tensor,
    group: int,
    x_scale: Tensor | None,
    out_dtype: torch.dtype,
    isa: str,
    threads: int | None,
) -> Tensor:
    x_q, scales, x_scale = _rows(x_q), _rows(scales), _unit_stride(x_scale)
    # A weight as stored is repacked on every call (callers that keep a weight pass its tiles); tiles are read by
    # the strides of a contiguous copy.
    w_packed = tile_int4_weight(w_packed) if w_packed.dim() == 2 else w_packed.contiguous()
    rows, depth = x_q.shape
    cols, groups = scales.shape
    out = torch.empty(rows, cols, dtype=out_dtype)
    if out.numel() == 0:
        return out
    args = (rows, depth, groups, x_q.data_ptr(), x_q.stride(0), w_packed.data_ptr(), *_layout(w_packed))
    args += (scales.data_ptr(), scales.stride(0), _ptr(x_scale), out.data_ptr(), cols)
    args += (int(out_dtype == torch.bfloat16),)
    _run("glm5_w4a8_gemm_nt", isa, _W4A8_ARGS, args, rows, cols, depth, threads)
    return out


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
    strides; repacked on every call), or tile_int4_weight(w_packed) (repacked once by the caller).
    scales: [N, G] fp32, G = K / group. group: columns per scale, K (per channel) or a multiple of STEP dividing K
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
        lambda: f"group: expected K = {k} or a multiple of {STEP} dividing it, got {group}",
    )
    _check_weight("w_packed", w_packed, torch.uint8, n, k // 2)
    check(
        tuple(scales.shape) == (n, k // group),
        ValueError,
        lambda: f"scales: expected [{n}, {k // group}], got {tuple(scales.shape)}",
    )
    _check_vector("x_scale", x_scale, m)
    _check_out_dtype(out_dtype)
    if isa == FAST and threads is None:
        return torch.ops.glm5_hal.native_w4a8_mm(x_q, w_packed, scales, group, x_scale, out_dtype)
    return _w4a8(x_q, w_packed, scales, group, x_scale, out_dtype, isa, threads)


def run_w8a8(
    x_q: Tensor,
    w_q: Tensor,
    n: int,
    x_scale: Tensor | None,
    w_scale: Tensor | None,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """w8a8_mm on arguments a validated op already checked (the backend), without the custom op's dispatch: at
    decode sizes each layer of Python costs a measurable share of the kernel's time."""
    return _w8a8(x_q, w_q, n, x_scale, w_scale, bias, out_dtype, FAST, None)


def run_w4a8(
    x_q: Tensor, w_packed: Tensor, scales: Tensor, group: int, x_scale: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """w4a8_mm on arguments a validated op already checked (the backend), without the custom op's dispatch."""
    return _w4a8(x_q, w_packed, scales, group, x_scale, out_dtype, FAST, None)


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define(
    "native_w8a8_mm(Tensor x_q, Tensor w_q, int n, Tensor? x_scale, Tensor? w_scale, Tensor? bias,"
    " ScalarType out_dtype) -> Tensor"
)
_LIBRARY.impl("native_w8a8_mm", lambda x, w, n, xs, ws, b, dtype: _w8a8(x, w, n, xs, ws, b, dtype, FAST, None), "CPU")
_LIBRARY.define(
    "native_w4a8_mm(Tensor x_q, Tensor w_packed, Tensor scales, int group, Tensor? x_scale, ScalarType out_dtype)"
    " -> Tensor"
)
_LIBRARY.impl("native_w4a8_mm", lambda x, w, s, group, xs, dtype: _w4a8(x, w, s, group, xs, dtype, FAST, None), "CPU")


@torch.library.register_fake("glm5_hal::native_w8a8_mm")
def _fake_w8a8(x_q, w_q, n, x_scale, w_scale, bias, out_dtype):
    return x_q.new_empty(x_q.shape[0], n, dtype=out_dtype)


@torch.library.register_fake("glm5_hal::native_w4a8_mm")
def _fake_w4a8(x_q, w_packed, scales, group, x_scale, out_dtype):
    return x_q.new_empty(x_q.shape[0], scales.shape[0], dtype=out_dtype)
