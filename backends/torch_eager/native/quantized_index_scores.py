"""The lightning indexer's scores from a paged cache of quantized index rows in one pass, on CPUs
(quantized_index_scores.c): each key row decoded once per chunk of tokens (its codes times its scale, exactly as
glm5_hal.kv_formats.decode_rows gives them), the q . k products of every head in fp32, their relu and the weighted
sum over heads, with the rows read in place from the cache (no gathered copy, no [T, HI, S] products).

    s = scores(q, weights, cache, tables, limits, width, "fp8_index")
    # q [T, H, D] bf16 / fp16 / fp32; weights [T, H] fp32;
    # cache [num_blocks, block_size, row_bytes] uint8: rows of kv_cache_dtype ("fp8_index" or "int8_index": D codes
    #   and one fp32 scale, D = 128);
    # tables [T, >= width / block_size] int32: each token's block table row, every entry a valid block index;
    # limits [T] int64: key positions >= limits[t] are not visible to token t (they get -inf)
    # s [T, width] fp32: s[t, p] = sum_h weights[t, h] * relu(q[t, h] . key(t, p)) for p < limits[t], else -inf

    s = paged_scores(q, weights, cache, block_table, seq_lens_k, cu_seqlens_q, width, "fp8_index", first_token=0)
    # the same scores over the op's paged batch (docs/ops.md "Conventions"): q, weights and s hold its tokens
    # first_token .. first_token + T - 1; each token's sequence, visible keys (its position and before) and table
    # row are found in the kernel (paged_tokens.h), and keys whose table entry names no block of the cache get -inf

vLLM stores DeepSeek-V3.2 / GLM-5 index keys as fp8_index rows, so this is the scorer of every indexer step served
through glm5-hal's vLLM plugin. Its queries are bf16: in the avx512_bf16 (and portable) build those take the bf16
route (quantized_index_scores.c's top: codes decoded to bf16, VDPBF16PS dots, each key's scale applied after its
dot, so each term is within 2^-24 of the fp32 route's), where nothing subnormal can occur; other queries, and chunks
with a scale it cannot take, run the fp32 route. On torch's intra-op thread count, split by tokens or by key
ranges. The custom op torch.ops.glm5_hal.native_quantized_index_scores is what aten-level spies, FakeTensor and
torch.compile see.

The AMX build is amx_quantized_index_scores.c: this source with the bf16 route's dots on AMX tiles (its TDPBF16PS
flushes subnormals as VDPBF16PS does, so the same guards apply); `isa` picks the build and, by default, the kernel
(kernel_for); `kernel=AMX_KERNEL, isa=PORTABLE` runs the AMX blocking on any CPU.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from backends.torch_eager.native import amx_tiles
from backends.torch_eager.native import threads as threads_
from backends.torch_eager.native.indexer_scores import check_score_arguments, check_score_operands, score_shares
from backends.torch_eager.native.row_prefetch import ROW_PREFETCHES, check_prefetch
from glm5_hal.checks import check
from glm5_hal.kv_formats import FORMATS
from glm5_hal.ops.common import plain_eager

AVX2 = "avx2"
AMX = "amx"  # the AMX kernel's build (AMX_KERNEL: the bf16 route's dots on tiles)
PORTABLE = "portable"
KERNEL = "quantized_index_scores"  # quantized_index_scores.c: the vector builds (AVX-512 BF16, AVX2, portable)
AMX_KERNEL = "amx_quantized_index_scores"  # the same source with its bf16 route on AMX tiles (AMX, PORTABLE, ...)
# kv_cache_dtype -> the kernel's code (CODE_* in quantized_index_scores.c)
CODES = {"fp8_index": 0, "int8_index": 1}
HEADS = 4  # HEADS in quantized_index_scores.c: q is padded with zero heads to a multiple of it
KEY_CHUNK = 256  # CHUNK in quantized_index_scores.c: a thread's share of key positions is a multiple of it
# How the kernel asks for the next chunk's rows where nothing measured it (row_prefetch.py: ROW_PREFETCHES; the torch
# backend's probe measures which is fastest here, the results are the same bits): non-temporally (the kernel's comment
# on prefetch_rows has the measurements).
DEFAULT_PREFETCH = "nta"

_L, _P, _I = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
_SHARE = [_L, _L, _L, _L]  # t_begin, t_end, s_begin, s_end
# heads, dims, code, q, w, cache, its strides, block_size, tables, table stride, limits, scores, score row, prefetch
_ARGTYPES = [_L, _L, _I, _P, _P, _P, _L, _L, _L, _P, _L, _P, _P, _L, _I, *_SHARE]
# heads, dims, code, q, w, cache, its strides, block_size, num_blocks, block table, its stride, max_blocks, seq_lens_k,
# cu_seqlens_q, B, first_token, scores, score row, width, prefetch
_PAGED_ARGTYPES = [_L, _L, _I, _P, _P, _P, _L, _L, _L, _L, _P, _L, _L, _P, _P, _L, _L, _P, _L, _L, _I, *_SHARE]


def kernel_for(isa: str, kernel: str | None = None) -> str:
    """The C kernel that runs for `isa`: `kernel` where given (KERNEL or AMX_KERNEL), else AMX_KERNEL for the AMX
    build and KERNEL for the others."""
    return amx_tiles.source_for(isa, KERNEL, AMX_KERNEL, kernel)


def _kernel(isa: str, paged: bool = False, kernel: str | None = None):
    if paged:
        name, argtypes = "glm5_quantized_index_scores_paged", _PAGED_ARGTYPES
    else:
        name, argtypes = "glm5_quantized_index_scores", _ARGTYPES
    return amx_tiles.any_function(kernel_for(isa, kernel), isa, name, argtypes, ctypes.c_int)


def availability(isa: str = AVX2, kernel: str | None = None) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel (kernel_for) built for `isa` here (built on first use;
    for the AMX kernel, Linux's grant of the tile state included)."""
    return amx_tiles.any_availability(kernel_for(isa, kernel), isa)


def _padded(t: Tensor, heads: int) -> Tensor:
    """[T, H, ...] as fp32 [T, Hp, ...], contiguous, zero past H (Hp: H rounded up to HEADS)."""
    if heads % HEADS == 0:  # no padding heads: one conversion (none for contiguous fp32), not a zero fill and a copy
        return t.to(torch.float32).contiguous()
    padded = t.new_zeros(t.shape[0], -(-heads // HEADS) * HEADS, *t.shape[2:], dtype=torch.float32)
    padded[:, :heads] = t
    return padded


def _run(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    tables: Tensor,
    limits: Tensor,
    out: Tensor,
    kv_cache_dtype: str,
    isa: str,
    threads: int | None,
    kernel: str | None = None,
    prefetch: str = DEFAULT_PREFETCH,
) -> Tensor:
    tokens, heads, dims = q.shape
    width = out.shape[1]
    if out.numel() == 0:
        return out
    q32, w = _padded(q, heads), _padded(weights, heads)
    tables = tables.to(torch.int32).contiguous()
    limits = limits.to(torch.int64).clamp(0, width).contiguous()
    args = (heads, dims, CODES[kv_cache_dtype], q32.data_ptr(), w.data_ptr(), cache.data_ptr(), cache.stride(0))
    args += (cache.stride(1), cache.shape[1], tables.data_ptr(), tables.stride(0), limits.data_ptr(), out.data_ptr())
    args += (out.stride(0), ROW_PREFETCHES[prefetch])
    shares = score_shares(tokens, heads, dims, width, KEY_CHUNK, threads)
    failed = threads_.failed_shares(_kernel(isa, kernel=kernel), args, shares)
    check(not failed, MemoryError, lambda: f"quantized index scores: no memory for a workspace of {dims}-wide keys")
    return out


def _check_format(q: Tensor, cache: Tensor, kv_cache_dtype: str) -> None:
    """q and the cache as the kernel reads them: D-wide float queries over rows of a quantized format."""
    check(kv_cache_dtype in CODES, ValueError, lambda: f"kv_cache_dtype: expected one of {tuple(CODES)}")
    fmt = FORMATS[kv_cache_dtype]
    check(
        q.dim() == 3 and q.is_floating_point() and q.dtype != torch.float64 and q.shape[2] == fmt.quantized_dims,
        TypeError,
        lambda: f"q: expected [T, H, {fmt.quantized_dims}] bf16, fp16 or fp32, got {tuple(q.shape)} {q.dtype}",
    )
    check(
        cache.dim() == 3 and cache.dtype == torch.uint8 and cache.shape[2] == fmt.row_bytes,
        TypeError,
        lambda: (
            f"cache: expected [blocks, block_size, {fmt.row_bytes}] uint8 {kv_cache_dtype} rows, "
            f"got {tuple(cache.shape)} {cache.dtype}"
        ),
    )


def scores(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    tables: Tensor,
    limits: Tensor,
    width: int,
    kv_cache_dtype: str,
    *,
    out: Tensor | None = None,
    isa: str = AVX2,
    threads: int | None = None,
    kernel: str | None = None,
    prefetch: str = DEFAULT_PREFETCH,
) -> Tensor:
    """The scores described in the module docstring, written into `out` ([T, width] fp32, rows contiguous) if
    given. isa: the build (backends.torch_eager.native.build.ISAS). threads: default torch's. kernel: KERNEL or
    AMX_KERNEL (default: kernel_for(isa); the tests run AMX_KERNEL's portable build, its blocking on any CPU).
    prefetch: how the kernel asks for the next chunk's rows (ROW_PREFETCHES; the same results, at another speed)."""
    _check_format(q, cache, kv_cache_dtype)
    check_prefetch("quantized index scores", prefetch)
    out = check_score_arguments(q, weights, cache, tables, limits, width, out)
    # The build is an argument of the op: torch.compile and FakeTensor see every build (plain eager: run directly).
    if threads is None and not plain_eager((q, weights, cache, out)):
        torch.ops.glm5_hal.native_quantized_index_scores(
            q, weights, cache, tables, limits, out, kv_cache_dtype, isa, kernel_for(isa, kernel), prefetch
        )
        return out
    return _run(q, weights, cache, tables, limits, out, kv_cache_dtype, isa, threads, kernel, prefetch)


def _run_paged(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    out: Tensor,
    kv_cache_dtype: str,
    first_token: int,
    isa: str,
    threads: int | None,
    kernel: str | None = None,
    prefetch: str = DEFAULT_PREFETCH,
) -> Tensor:
    tokens, heads, dims = q.shape
    width = out.shape[1]
    if out.numel() == 0:
        return out
    q32, w = _padded(q, heads), _padded(weights, heads)
    table = block_table if block_table.stride(1) == 1 or block_table.shape[1] <= 1 else block_table.contiguous()
    seq_lens_k, cu_seqlens_q = seq_lens_k.contiguous(), cu_seqlens_q.contiguous()
    args = (heads, dims, CODES[kv_cache_dtype], q32.data_ptr(), w.data_ptr(), cache.data_ptr(), cache.stride(0))
    args += (cache.stride(1), cache.shape[1], cache.shape[0], table.data_ptr(), table.stride(0), table.shape[1])
    args += (seq_lens_k.data_ptr(), cu_seqlens_q.data_ptr(), table.shape[0], first_token, out.data_ptr())
    args += (out.stride(0), width, ROW_PREFETCHES[prefetch])
    shares = score_shares(tokens, heads, dims, width, KEY_CHUNK, threads)
    failed = threads_.failed_shares(_kernel(isa, paged=True, kernel=kernel), args, shares)
    check(not failed, MemoryError, lambda: f"quantized index scores: no memory for a workspace of {dims}-wide keys")
    return out


def paged_scores(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    width: int,
    kv_cache_dtype: str,
    *,
    first_token: int = 0,
    out: Tensor | None = None,
    isa: str = AVX2,
    threads: int | None = None,
    validated: bool = False,
    kernel: str | None = None,
    prefetch: str = DEFAULT_PREFETCH,
) -> Tensor:
    """The paged form of `scores` (module docstring), written into `out` ([T, width] fp32, rows contiguous) if
    given: block_table [B, max_blocks] int32 (max_blocks * block_size >= width), seq_lens_k [B] and cu_seqlens_q
    [B + 1] int32, as the op takes them. isa, kernel, prefetch: as `scores`. threads: default torch's. validated: the
    caller has established what this would check (the kinds and shapes of every argument, CPU tensors, the cache's
    rows contiguous, out as above, the prefetch name): the torch backend, behind glm5_hal.lightning_indexer's
    validation and its native route's conditions (a decode step otherwise runs every check twice, ~0.03 ms a layer
    inside an engine). The kernel itself bounds every block id by the cache and every key by the table."""
    if validated:
        out = torch.empty(q.shape[0], width, dtype=torch.float32) if out is None else out
    else:
        _check_format(q, cache, kv_cache_dtype)
        check_prefetch("quantized index scores", prefetch)
        batch = block_table.shape[0] if block_table.dim() == 2 else -1
        check(
            block_table.dim() == 2
            and block_table.dtype == torch.int32
            and block_table.shape[1] * cache.shape[1] >= width,
            ValueError,
            lambda: (
                f"block_table: expected [B, >= {width} / {cache.shape[1]}] int32, got {tuple(block_table.shape)} "
                f"{block_table.dtype}"
            ),
        )
        for name, t, size in (("seq_lens_k", seq_lens_k, batch), ("cu_seqlens_q", cu_seqlens_q, batch + 1)):
            check(
                tuple(t.shape) == (size,) and t.dtype == torch.int32,
                ValueError,
                lambda t=t, n=name, size=size: f"{n}: expected [{size}] int32, got {tuple(t.shape)} {t.dtype}",
            )
        check(first_token >= 0, ValueError, lambda: f"first_token: expected >= 0, got {first_token}")
        for name, t in (("block_table", block_table), ("seq_lens_k", seq_lens_k), ("cu_seqlens_q", cu_seqlens_q)):
            check(t.device.type == "cpu", ValueError, lambda t=t, n=name: f"{n}: expected a CPU tensor, got {t.device}")
        out = check_score_operands(q, weights, cache, width, out)
    if threads is None and not plain_eager((q, weights, cache, out)):
        batch = (block_table, seq_lens_k, cu_seqlens_q)
        torch.ops.glm5_hal.native_quantized_index_scores_paged(
            q, weights, cache, *batch, out, kv_cache_dtype, first_token, isa, kernel_for(isa, kernel), prefetch
        )
        return out
    batch = (block_table, seq_lens_k, cu_seqlens_q)
    return _run_paged(q, weights, cache, *batch, out, kv_cache_dtype, first_token, isa, threads, kernel, prefetch)


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define(
    "native_quantized_index_scores(Tensor q, Tensor weights, Tensor cache, Tensor tables, Tensor limits, "
    f"Tensor(a!) out, str kv_cache_dtype, str isa='{AVX2}', str kernel='{KERNEL}', "
    f"str prefetch='{DEFAULT_PREFETCH}') -> ()"
)


def _cpu_op(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    tables: Tensor,
    limits: Tensor,
    out: Tensor,
    kv_cache_dtype: str,
    isa: str = AVX2,
    kernel: str = KERNEL,
    prefetch: str = DEFAULT_PREFETCH,
) -> None:
    _run(q, weights, cache, tables, limits, out, kv_cache_dtype, isa, None, kernel, prefetch)


_LIBRARY.impl("native_quantized_index_scores", _cpu_op, "CPU")


@torch.library.register_fake("glm5_hal::native_quantized_index_scores")
def _fake(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    tables: Tensor,
    limits: Tensor,
    out: Tensor,
    kv_cache_dtype: str,
    isa: str = AVX2,
    kernel: str = KERNEL,
    prefetch: str = DEFAULT_PREFETCH,
) -> None:
    return None


_LIBRARY.define(
    "native_quantized_index_scores_paged(Tensor q, Tensor weights, Tensor cache, Tensor block_table, "
    "Tensor seq_lens_k, Tensor cu_seqlens_q, Tensor(a!) out, str kv_cache_dtype, int first_token, "
    f"str isa='{AVX2}', str kernel='{KERNEL}', str prefetch='{DEFAULT_PREFETCH}') -> ()"
)


def _paged_cpu_op(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    out: Tensor,
    kv_cache_dtype: str,
    first_token: int,
    isa: str = AVX2,
    kernel: str = KERNEL,
    prefetch: str = DEFAULT_PREFETCH,
) -> None:
    batch = (block_table, seq_lens_k, cu_seqlens_q)
    _run_paged(q, weights, cache, *batch, out, kv_cache_dtype, first_token, isa, None, kernel, prefetch)


_LIBRARY.impl("native_quantized_index_scores_paged", _paged_cpu_op, "CPU")


@torch.library.register_fake("glm5_hal::native_quantized_index_scores_paged")
def _paged_fake(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    out: Tensor,
    kv_cache_dtype: str,
    first_token: int,
    isa: str = AVX2,
    kernel: str = KERNEL,
    prefetch: str = DEFAULT_PREFETCH,
) -> None:
    return None
