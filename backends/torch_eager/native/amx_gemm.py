"""GEMMs on AMX tiles (amx_gemm.c): bf16 x bf16 -> fp32, and int8 x int8 -> exact int32.

    out = bmm_nt(a, b)            # a [B, M, K] bf16, b [B, N, K] bf16 -> [B, M, N] fp32, out = a @ b^T
    acc = s8_mm(x_q, w_q)         # x_q [M, K] int8, w_q [N, K] int8 -> [M, N] int32, the exact sums
    weight = prepare_s8(w_q)      # once per weight: its panels, their address, the C function
    acc = run_s8(x_q, weight)     # per call, arguments already validated
    ok, why = availability()      # whether the AMX build runs here (CPU flags, compiler, Linux's tile state)

bmm_nt has bf16_gemm.bmm_nt's interface and contract: the fp32 sums of the exact bf16 products, which equal the fp32
GEMM of the upcast operands up to the order of the sums, any strides, a batch stride of 0. Two differences of the tile
instruction: bf16 subnormal inputs are read as zero, and fp32 subnormal results are flushed to zero (an absolute
difference below 2^-126 = 1.2e-38 per input product or result).

s8_mm / run_s8 return the int32 accumulators the W8A8 routes scale (as torch._int_mm(x_q, w_q.T), exact while the sums
fit int32: always for K <= 2^17); the weight is read in panels of 32 columns (panel_s8_weight, made once per weight
by prepare_s8, as int8_gemm.prepare_w8a8), a weight as stored is copied into panels on every call.

The AMX build runs only where the CPU has amx_tile / amx_bf16 / amx_int8 and Linux grants the tile state
(amx_tiles.py); the portable build (the same blocking around scalar tile operations that follow the instructions'
arithmetic, amx_tiles.h) runs on any CPU, for the tests. Both are custom ops (torch.ops.glm5_hal.amx_bf16_bmm_nt,
torch.ops.glm5_hal.amx_s8_mm) split over torch's intra-op thread count by batches or blocks of 32 columns; a result
does not depend on the split.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from backends.torch_eager.native import amx_tiles
from backends.torch_eager.native import threads as threads_
from backends.torch_eager.native.int8_gemm import _check_cpu, _contiguous, _rows
from glm5_hal.checks import check

KERNEL = "amx_gemm"  # build.SYMBOLS
FAST = "amx"  # build.ISAS: the AMX build
PORTABLE = "portable"  # the same blocking with scalar tile operations (tests, any CPU)
BLOCK_COLUMNS = 32  # NB in amx_gemm.c: two 16-column tiles; a thread's share of the columns is whole blocks
TILE_ROWS = 16  # rows of a tile; a B tile row holds one K pair (bf16) or quad (int8) of 16 columns
TILE_COLUMNS = 16  # columns of the result per tile
S8_STEP = 64  # int8 of K per tile row: a panel's K step
QUAD = 4  # int8 of K per column in a B tile row (TDPBSSD's dword)

_C_LONG, _PTR = ctypes.c_long, ctypes.c_void_p
_SHARE = [_C_LONG] * 2  # n_begin, n_end (and b_begin, b_end before them for the bf16 GEMM)
_BF16_ARGS = [
    _C_LONG,
    _C_LONG,
    _PTR,
    _C_LONG,
    _C_LONG,
    _PTR,
    _C_LONG,
    _C_LONG,
    _PTR,
    _C_LONG,
    _C_LONG,
    *_SHARE,
    *_SHARE,
]
_S8_ARGS = [_C_LONG, _C_LONG, _PTR, _C_LONG, _PTR, _C_LONG, _PTR, _C_LONG, *_SHARE]
_BF16, _S8 = "glm5_amx_bf16_gemm_nt", "glm5_amx_s8_gemm_nt"  # the C functions


def availability(isa: str = FAST) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the build for `isa` here (built on first use; for the AMX build,
    Linux's grant of the tile state included)."""
    return amx_tiles.availability(KERNEL, isa)


# ------------------------------------------------------------------------------------------------ bf16 x bf16 -> fp32


def _bf16_run(a: Tensor, b: Tensor, isa: str, threads: int | None) -> Tensor:
    a, b = _rows(a), _rows(b)
    batch, rows, depth = a.shape
    cols = b.shape[1]
    out = torch.empty(batch, rows, cols, dtype=torch.float32)
    if out.numel() == 0:
        return out
    args = (rows, depth, a.data_ptr(), *a.stride()[:2], b.data_ptr(), *b.stride()[:2], out.data_ptr())
    args += tuple(out.stride()[:2])
    parts = threads_.thread_count(2 * batch * rows * cols * depth, threads)
    if batch >= parts:  # whole batches per thread, else blocks of columns
        shares = [(b0, b1, 0, cols) for b0, b1 in threads_.split(batch, parts)]
    else:
        shares = [(0, batch, n0, n1) for n0, n1 in threads_.split(cols, parts, BLOCK_COLUMNS)]
    kernel = amx_tiles.function(KERNEL, isa, _BF16, _BF16_ARGS, ctypes.c_int)
    if threads_.failed_shares(kernel, args, shares):
        raise MemoryError(f"{_BF16}: no memory for its panel (K = {depth})")
    return out


def bmm_nt(a: Tensor, b: Tensor, *, isa: str = FAST, threads: int | None = None) -> Tensor:
    """a [B, M, K] bf16 @ b [B, N, K]^T bf16 -> [B, M, N] fp32 on AMX tiles, on the CPU (any strides; a batch stride
    of 0, as from expand, reads the same matrix for every batch; any empty dimension). The fp32 sums of the exact
    products, bf16 subnormals read as zero (module docstring). isa: the build (FAST, or PORTABLE for tests;
    build.NativeUnavailable where it cannot run). threads: default torch's."""
    for name, t in (("a", a), ("b", b)):
        _check_cpu(name, t, 3, torch.bfloat16)
    check(
        a.shape[0] == b.shape[0] and a.shape[2] == b.shape[2],
        ValueError,
        lambda: f"b: expected [{a.shape[0]}, N, {a.shape[2]}] to match a {tuple(a.shape)}, got {tuple(b.shape)}",
    )
    if isa == FAST and threads is None:
        return torch.ops.glm5_hal.amx_bf16_bmm_nt(a, b)
    return _bf16_run(a, b, isa, threads)


# ------------------------------------------------------------------------------------------------ int8 x int8 -> int32


def panel_s8_weight(w_q: Tensor) -> Tensor:
    """w_q [N, K] int8 -> the int8 GEMM's weight, [ceil(N / 32), ceil(K / 64), 2, 16, 16, 4] int8: per block of 32
    columns and K step of 64, its two B tiles, tile row q holding k = 64 s + 4 q .. + 3 of each of the tile's 16
    columns (TDPBSSD's quad layout); zero past N and K."""
    n, k = w_q.shape
    blocks, steps = -(-n // BLOCK_COLUMNS), -(-k // S8_STEP)
    padded = w_q.new_zeros(blocks * BLOCK_COLUMNS, steps * S8_STEP)
    padded[:n, :k] = w_q
    tiles = padded.view(blocks, 2, TILE_COLUMNS, steps, TILE_ROWS, QUAD)  # [block, tile, column, step, quad, byte]
    return tiles.permute(0, 3, 1, 4, 2, 5).contiguous()


@dataclass(frozen=True)
class S8Weight:
    """A weight in the int8 GEMM's panels with what every call reads of it (prepare_s8; the backend caches it)."""

    panels: Tensor  # contiguous [ceil(N / 32), ceil(K / 64), 2, 16, 16, 4] int8 (panel_s8_weight)
    columns: int  # N: the weight's rows, the product's columns
    depth: int  # K
    address: int  # panels.data_ptr()
    panel_stride: int  # panels.stride(0), in bytes
    kernel: ctypes._CFuncPtr  # glm5_amx_s8_gemm_nt, built for the ISA it was prepared for


def _s8_weight(w_q: Tensor, n: int, k: int, isa: str) -> S8Weight:
    panels = _contiguous(panel_s8_weight(w_q) if w_q.dim() == 2 else w_q)
    kernel = amx_tiles.function(KERNEL, isa, _S8, _S8_ARGS)
    return S8Weight(panels, n, k, panels.data_ptr(), panels.stride(0), kernel)


def prepare_s8(w_q: Tensor, *, isa: str = FAST) -> S8Weight:
    """w_q [N, K] int8 -> what run_s8 takes: its panels (panel_s8_weight) and the kernel of `isa`'s build
    (build.NativeUnavailable where it cannot run)."""
    _check_cpu("w_q", w_q, 2, torch.int8)
    return _s8_weight(w_q, w_q.shape[0], w_q.shape[1], isa)


def run_s8(x_q: Tensor, weight: S8Weight, threads: int | None = None) -> Tensor:
    """x_q [M, K] int8 (rows K-contiguous, else copied) on a prepared weight (prepare_s8, K = weight.depth) ->
    [M, N] int32, the exact sums, arguments already validated (the backend's route), without the custom op."""
    x_q = _rows(x_q)
    rows, depth = x_q.shape
    cols = weight.columns
    out = torch.empty(rows, cols, dtype=torch.int32)
    if not rows or not cols:
        return out
    args = (rows, depth, x_q.data_ptr(), x_q.stride(0), weight.address, weight.panel_stride, out.data_ptr(), cols)
    parts = threads_.thread_count(2 * rows * cols * depth, threads)
    threads_.run_shares(weight.kernel, args, threads_.split(cols, parts, BLOCK_COLUMNS))
    return out


def s8_mm(x_q: Tensor, w_q: Tensor, n: int | None = None, *, isa: str = FAST, threads: int | None = None) -> Tensor:
    """x_q [M, K] int8 @ w_q [N, K]^T int8 -> [M, N] int32, the exact integer sums (torch._int_mm(x_q, w_q.T)'s
    values; exact while they fit int32, as they always do for K <= 2^17). w_q: as stored (any strides; copied into
    panels on every call) or panel_s8_weight(w_q) (copied once by the caller), n: its rows (needed for panels).
    isa: the build (FAST, or PORTABLE for tests; build.NativeUnavailable where it cannot run). threads: default
    torch's."""
    _check_cpu("x_q", x_q, 2, torch.int8)
    m, k = x_q.shape
    n = w_q.shape[0] if n is None else n
    if w_q.dim() == 6:
        _check_cpu("w_q", w_q, 6, torch.int8)
        want = (-(-n // BLOCK_COLUMNS), -(-k // S8_STEP), 2, TILE_ROWS, TILE_COLUMNS, QUAD)
    else:
        _check_cpu("w_q", w_q, 2, torch.int8)
        want = (n, k)
    check(tuple(w_q.shape) == want, ValueError, lambda: f"w_q: expected {want}, got {tuple(w_q.shape)}")
    if isa == FAST and threads is None:
        return torch.ops.glm5_hal.amx_s8_mm(x_q, w_q, n)
    return run_s8(x_q, _s8_weight(w_q, n, k, isa), threads)


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define("amx_bf16_bmm_nt(Tensor a, Tensor b) -> Tensor")
_LIBRARY.impl("amx_bf16_bmm_nt", lambda a, b: _bf16_run(a, b, FAST, None), "CPU")
_LIBRARY.define("amx_s8_mm(Tensor x_q, Tensor w_q, int n) -> Tensor")
_LIBRARY.impl("amx_s8_mm", lambda x, w, n: run_s8(x, _s8_weight(w, n, x.shape[1], FAST)), "CPU")


@torch.library.register_fake("glm5_hal::amx_bf16_bmm_nt")
def _fake_bf16(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], a.shape[1], b.shape[1], dtype=torch.float32)


@torch.library.register_fake("glm5_hal::amx_s8_mm")
def _fake_s8(x_q: Tensor, w_q: Tensor, n: int) -> Tensor:
    return x_q.new_empty(x_q.shape[0], n, dtype=torch.int32)
