"""bf16 x bf16 GEMMs that hand back their fp32 accumulators, on CPUs (bf16_gemm.c): the GEMM torch's CPU kernels
lack. Theirs round a bf16 product's result to bf16, so an exact fast path there needs a second, residual GEMM
(backends/torch_eager/gemm.py); this one returns fp32 in one pass, so products that are weight-bound (decode, MoE
experts) read the bf16 weight once instead of twice or upcast.

    out = bmm_nt(a, b)        # a [B, M, K] bf16, b [B, N, K] bf16 -> out [B, M, N] fp32, out = a @ b^T
    ok, why = availability()  # whether the AVX-512 BF16 build runs on this machine, and why not

Both operands are K-contiguous (b is the weight [N, K] of a linear, or the keys [N, K] of an attention score), the
layout a dot-product instruction wants; another layout is copied into it first. The product is computed in fp32
from the exact bf16 x bf16 products: it equals the fp32 GEMM of the upcast operands up to the order of the sums.

The GEMM is the custom op torch.ops.glm5_hal.native_bf16_bmm_nt, so aten-level spies, FakeTensor and torch.compile
see it like any GEMM. It runs on as many threads as torch's intra-op pool has (Python threads: the ctypes call
releases the GIL), split by batch or by columns; a result does not depend on the split.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import Tensor

from backends.torch_eager.native import build
from backends.torch_eager.native import threads as threads_
from glm5_hal.checks import check
from glm5_hal.ops.common import plain_eager

FAST = "avx512_bf16"  # build.ISAS: the kernel the backend uses
AVX2 = "avx2"  # 256-bit FMA on exactly widened bf16: CPUs without AVX-512 (a 3 x 4 tile, NR = TILE_COLUMNS)
PORTABLE = "portable"  # the same blocking with scalar arithmetic (tests, any CPU)
TILE_COLUMNS = 4  # NR in bf16_gemm.c: a thread's share of columns is a multiple of it

_C_LONG, _PTR = ctypes.c_long, ctypes.c_void_p
_ARGTYPES = [_C_LONG, _C_LONG, _PTR, _C_LONG, _C_LONG, _PTR, _C_LONG, _C_LONG, _PTR, _C_LONG, _C_LONG] + [_C_LONG] * 4


def _kernel(isa: str):
    return build.function("bf16_gemm", isa, "glm5_bf16_gemm_nt", _ARGTYPES)


def availability(isa: str = FAST) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel built for `isa` here (built on first use)."""
    return build.availability("bf16_gemm", isa)


def _k_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _run(a: Tensor, b: Tensor, isa: str, threads: int | None) -> Tensor:
    a, b = _k_contiguous(a), _k_contiguous(b)
    batch, rows, depth = a.shape
    cols = b.shape[1]
    out = torch.empty(batch, rows, cols, dtype=torch.float32)
    if out.numel() == 0:
        return out
    args = (
        rows,
        depth,
        a.data_ptr(),
        *a.stride()[:2],
        b.data_ptr(),
        *b.stride()[:2],
        out.data_ptr(),
        *out.stride()[:2],
    )
    parts = threads_.thread_count(2 * batch * rows * cols * depth, threads)
    if batch >= parts:  # whole batches per thread, else ranges of columns
        shares = [(b0, b1, 0, cols) for b0, b1 in threads_.split(batch, parts)]
    else:
        shares = [(0, batch, n0, n1) for n0, n1 in threads_.split(cols, parts, TILE_COLUMNS)]
    threads_.run_shares(_kernel(isa), args, shares)
    return out


def bmm_nt(a: Tensor, b: Tensor, *, isa: str = FAST, threads: int | None = None) -> Tensor:
    """a [B, M, K] bf16 @ b [B, N, K]^T bf16 -> [B, M, N] fp32, on the CPU (any strides; a batch stride of 0, as
    from expand, reads the same matrix for every batch). isa: the build (backends.torch_eager.native.build.ISAS; the
    default is the AVX-512 BF16 one; build.NativeUnavailable where it cannot run). threads: default torch's."""
    for name, t in (("a", a), ("b", b)):
        check(t.dim() == 3, ValueError, lambda t=t, n=name: f"{n}: expected [B, rows, K], got shape {tuple(t.shape)}")
        check(t.dtype == torch.bfloat16, TypeError, lambda t=t, n=name: f"{n}: expected bfloat16, got {t.dtype}")
        check(t.device.type == "cpu", ValueError, lambda t=t, n=name: f"{n}: expected a CPU tensor, got {t.device}")
    check(
        a.shape[0] == b.shape[0] and a.shape[2] == b.shape[2],
        ValueError,
        lambda: f"b: expected [{a.shape[0]}, N, {a.shape[2]}] to match a {tuple(a.shape)}, got {tuple(b.shape)}",
    )
    # The build is an argument of the op: torch.compile and FakeTensor see every build (plain eager: run directly).
    if threads is None and not plain_eager((a, b)):
        return torch.ops.glm5_hal.native_bf16_bmm_nt(a, b, isa)
    return _run(a, b, isa, threads)


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define(f"native_bf16_bmm_nt(Tensor a, Tensor b, str isa='{FAST}') -> Tensor")
_LIBRARY.impl("native_bf16_bmm_nt", lambda a, b, isa=FAST: _run(a, b, isa, None), "CPU")


@torch.library.register_fake("glm5_hal::native_bf16_bmm_nt")
def _fake(a: Tensor, b: Tensor, isa: str = FAST) -> Tensor:
    return a.new_empty(a.shape[0], a.shape[1], b.shape[1], dtype=torch.float32)


EXACTNESS_DEPTH = 2100  # past bf16_gemm.c's K block (KC = 1024) twice, with a tail that is not a multiple of 32


def is_exact(
    gen: torch.Generator, isa: str = FAST, product: Callable[[Tensor, Tensor], Tensor] | None = None
) -> tuple[bool, str]:
    """Whether the kernel's results here are fp32 sums of the exact bf16 products: each within the error bound of
    fp32 summation (depth x 2^-24 x sum |a b|) of the float64 product, none rounded to bf16, and NaN exactly where
    the float64 product has it. Ragged rows and columns, and a K tail, are included. product: another kernel of
    bmm_nt's contract to check instead (the AMX GEMM), named by `isa`."""
    a = torch.randn(2, 7, EXACTNESS_DEPTH, generator=gen).bfloat16()
    b = torch.randn(2, 13, EXACTNESS_DEPTH, generator=gen).bfloat16()
    a[1, 3, 17] = float("nan")
    want = torch.bmm(a.double(), b.double().mT)
    name = f"bf16_gemm_{isa}" if product is None else isa
    got = (bmm_nt(a, b, isa=isa) if product is None else product(a, b)).double()
    if not torch.equal(got.isnan(), want.isnan()):
        return False, f"{name}: NaN where the float64 product has none, or none where it has"
    finite = want.isfinite()
    error = (got - want).abs()[finite]
    bound = (EXACTNESS_DEPTH * 2.0**-24 * torch.bmm(a.double().abs(), b.double().abs().mT).nan_to_num())[finite]
    if (error > bound).any():
        return False, f"{name}: off by {float((error / bound).max()):.3g}x the fp32 summation bound"
    if error.max() > 2.0**-13 * want[finite].abs().max():
        return False, f"{name}: results rounded (error {float(error.max()):.3g})"
    what = availability(isa)[1].split(" (")[0] if product is None else name  # the portable build may run instead
    return True, f"{what}, fp32 sums of exact bf16 products (checked at K = {EXACTNESS_DEPTH})"
