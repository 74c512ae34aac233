"""The lightning indexer's scores from a paged bf16 key cache in one pass, on CPUs (indexer_scores.c): the q . k
products of every head, their relu, and the weighted sum over heads, with the keys read in place from the cache
(no gathered copy) and every sum in fp32, as in the fp32 path.

    s = scores(q, weights, cache, tables, limits, width)
    # q [T, H, D] bf16; weights [T, H] fp32; cache [num_blocks, block_size, D] bf16;
    # tables [T, >= width / block_size] int32: each token's block table row, every entry a valid block index;
    # limits [T] int64: key positions >= limits[t] are not visible to token t (they get -inf)
    # s [T, width] fp32: s[t, p] = sum_h weights[t, h] * relu(q[t, h] . key(t, p)) for p < limits[t], else -inf

On torch's intra-op thread count, split by tokens or by key ranges. The custom op torch.ops.glm5_hal.
native_indexer_scores is what aten-level spies, FakeTensor and torch.compile see.

Two C kernels share the entry point: indexer_scores.c (vector builds: AVX-512 BF16, AVX2, portable) and, for the AMX
build, amx_index_scores.c (the products as tile GEMMs; its bf16 inputs are read with the tile instruction's DAZ and
its fp32 sums flushed below 1.2e-38, amx_tiles.h). `isa` picks the build and, by default, the kernel (kernel_for);
`kernel=AMX_KERNEL, isa=PORTABLE` runs the AMX blocking on any CPU.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from backends.torch_eager.native import amx_tiles
from backends.torch_eager.native import threads as threads_
from backends.torch_eager.native.packing import HEAD_LANES, head_pairs
from glm5_hal.checks import check
from glm5_hal.ops.common import plain_eager

FAST = "avx512_bf16"
AVX2 = "avx2"  # 256-bit FMA on exactly widened bf16: CPUs without AVX-512
AMX = "amx"  # the AMX kernel's build (AMX_KERNEL: the products on tiles)
PORTABLE = "portable"
KERNEL = "indexer_scores"  # indexer_scores.c: the vector builds (FAST, AVX2, PORTABLE)
AMX_KERNEL = "amx_index_scores"  # amx_index_scores.c: the same entry point on AMX tiles (AMX, PORTABLE: its blocking)
KEY_CHUNK = 256  # CHUNK in both sources: a thread's share of key positions is a multiple of it

_C_LONG, _PTR = ctypes.c_long, ctypes.c_void_p
_ARGTYPES = [_C_LONG, _C_LONG, _PTR, _PTR, _PTR, _C_LONG, _C_LONG, _C_LONG, _PTR, _C_LONG, _PTR, _PTR, _C_LONG]
_ARGTYPES += [_C_LONG] * 4


def kernel_for(isa: str, kernel: str | None = None) -> str:
    """The C kernel that runs for `isa`: `kernel` where given (KERNEL or AMX_KERNEL), else AMX_KERNEL for the AMX
    build and KERNEL for the others."""
    return amx_tiles.source_for(isa, KERNEL, AMX_KERNEL, kernel)


def _kernel(isa: str, kernel: str | None = None):
    return amx_tiles.any_function(kernel_for(isa, kernel), isa, "glm5_indexer_scores", _ARGTYPES, ctypes.c_int)


def availability(isa: str = FAST, kernel: str | None = None) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel (kernel_for) built for `isa` here (built on first use;
    for the AMX kernel, Linux's grant of the tile state included)."""
    return amx_tiles.any_availability(kernel_for(isa, kernel), isa)


def _padded_weights(weights: Tensor) -> Tensor:
    """weights [T, H] as [T, Hp] fp32, zero past H (Hp as in packing.head_pairs)."""
    tokens, heads = weights.shape
    w = weights.new_zeros(tokens, -(-heads // HEAD_LANES) * HEAD_LANES, dtype=torch.float32)
    w[:, :heads] = weights
    return w


def _run(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    tables: Tensor,
    limits: Tensor,
    out: Tensor,
    isa: str,
    threads: int | None,
    kernel: str | None = None,
) -> Tensor:
    tokens, heads, dims = q.shape
    width = out.shape[1]
    if out.numel() == 0:
        return out
    packed, w = head_pairs(q), _padded_weights(weights)
    tables = tables.to(torch.int32).contiguous()
    limits = limits.to(torch.int64).clamp(0, width).contiguous()
    args = (
        heads,
        dims,
        packed.data_ptr(),
        w.data_ptr(),
        cache.data_ptr(),
        cache.stride(0),
        cache.stride(1),
        cache.shape[1],
        tables.data_ptr(),
        tables.stride(0),
        limits.data_ptr(),
        out.data_ptr(),
        out.stride(0),
    )
    shares = score_shares(tokens, heads, dims, width, KEY_CHUNK, threads)
    failed = threads_.failed_shares(_kernel(isa, kernel), args, shares)
    check(not failed, MemoryError, lambda: f"indexer scores: no memory for the workspace ({heads} heads, D {dims})")
    return out


def score_shares(
    tokens: int, heads: int, dims: int, width: int, key_chunk: int, threads: int | None
) -> list[tuple[int, int, int, int]]:
    """The (t_begin, t_end, s_begin, s_end) share of each thread of a scoring call: whole tokens per thread, or, with
    fewer tokens than threads (decode), ranges of key positions that are multiples of the kernel's `key_chunk`."""
    parts = threads_.thread_count(2 * tokens * heads * dims * width, threads)
    if tokens >= parts:
        return [(t0, t1, 0, width) for t0, t1 in threads_.split(tokens, parts)]
    return [(0, tokens, s0, s1) for s0, s1 in threads_.split(width, parts, key_chunk)]


def check_score_arguments(
    q: Tensor, weights: Tensor, cache: Tensor, tables: Tensor, limits: Tensor, width: int, out: Tensor | None
) -> Tensor:
    """The checks every scoring kernel's wrapper makes beyond its q and cache formats (cache rows contiguous, the
    shapes of weights, tables, limits and out, CPU tensors); returns `out`, made if None."""
    tokens = q.shape[0]
    check(
        tables.dim() == 2 and tables.shape[0] == tokens and tables.shape[1] * cache.shape[1] >= width,
        ValueError,
        lambda: f"tables: expected [{tokens}, >= {width} / {cache.shape[1]}], got {tuple(tables.shape)}",
    )
    check(
        tuple(limits.shape) == (tokens,), ValueError, lambda: f"limits: expected [{tokens}], got {tuple(limits.shape)}"
    )
    for name, t in (("tables", tables), ("limits", limits)):
        check(t.device.type == "cpu", ValueError, lambda t=t, n=name: f"{n}: expected a CPU tensor, got {t.device}")
    return check_score_operands(q, weights, cache, width, out)


def check_score_operands(q: Tensor, weights: Tensor, cache: Tensor, width: int, out: Tensor | None) -> Tensor:
    """What a scoring kernel's wrapper checks of q, weights, the cache and out, however it is told where each
    token's keys are (cache rows contiguous, the shapes of weights and out, CPU tensors); returns `out`, made if
    None."""
    tokens = q.shape[0]
    check(
        cache.stride(-1) == 1, ValueError, lambda: f"cache: expected rows contiguous in D, got strides {cache.stride()}"
    )
    check(
        tuple(weights.shape) == tuple(q.shape[:2]),
        ValueError,
        lambda: f"weights: expected {tuple(q.shape[:2])}, got {tuple(weights.shape)}",
    )
    for name, t in (("q", q), ("weights", weights), ("cache", cache)):
        check(t.device.type == "cpu", ValueError, lambda t=t, n=name: f"{n}: expected a CPU tensor, got {t.device}")
    if out is None:
        out = torch.empty(tokens, width, dtype=torch.float32)
    check(
        tuple(out.shape) == (tokens, width) and out.dtype == torch.float32 and (out.stride(1) == 1 or width <= 1),
        ValueError,
        lambda: f"out: expected [{tokens}, {width}] fp32 with contiguous rows, got {tuple(out.shape)}",
    )
    return out


def scores(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    tables: Tensor,
    limits: Tensor,
    width: int,
    *,
    out: Tensor | None = None,
    isa: str = FAST,
    threads: int | None = None,
    kernel: str | None = None,
) -> Tensor:
    """The scores described in the module docstring, written into `out` ([T, width] fp32, rows contiguous) if
    given. isa: the build (backends.torch_eager.native.build.ISAS). threads: default torch's. kernel: KERNEL or
    AMX_KERNEL (default: kernel_for(isa); the tests run AMX_KERNEL's portable build, its blocking on any CPU)."""
    check(
        q.dim() == 3 and q.dtype == torch.bfloat16,
        TypeError,
        lambda: f"q: expected [T, H, D] bf16, got {tuple(q.shape)} {q.dtype}",
    )
    check(
        cache.dim() == 3 and cache.dtype == torch.bfloat16 and cache.shape[2] == q.shape[2],
        TypeError,
        lambda: f"cache: expected [blocks, block_size, {q.shape[2]}] bf16, got {tuple(cache.shape)} {cache.dtype}",
    )
    out = check_score_arguments(q, weights, cache, tables, limits, width, out)
    # The build is an argument of the op: torch.compile and FakeTensor see every build (plain eager: run directly).
    if threads is None and not plain_eager((q, weights, cache, out)):
        torch.ops.glm5_hal.native_indexer_scores(q, weights, cache, tables, limits, out, isa, kernel_for(isa, kernel))
        return out
    return _run(q, weights, cache, tables, limits, out, isa, threads, kernel)


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define(
    "native_indexer_scores(Tensor q, Tensor weights, Tensor cache, Tensor tables, Tensor limits, Tensor(a!) out, "
    f"str isa='{FAST}', str kernel='{KERNEL}') -> ()"
)


def _cpu_op(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    tables: Tensor,
    limits: Tensor,
    out: Tensor,
    isa: str = FAST,
    kernel: str = KERNEL,
) -> None:  # the op returns nothing: it writes `out`
    _run(q, weights, cache, tables, limits, out, isa, None, kernel)


_LIBRARY.impl("native_indexer_scores", _cpu_op, "CPU")


@torch.library.register_fake("glm5_hal::native_indexer_scores")
def _fake(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    tables: Tensor,
    limits: Tensor,
    out: Tensor,
    isa: str = FAST,
    kernel: str = KERNEL,
) -> None:
    return None
