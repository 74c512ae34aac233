"""Sparse attention straight from a paged bf16 latent cache, on CPUs (sparse_attention.c): per token, the scores
over its selected rows, an fp32 softmax and the value product in one kernel, with the scores in a per-thread
workspace that stays in cache. No gathered copy of the selected rows and no [T, topk, H] tensor: at GLM-5 decode
the torch softmax's passes between two separate products cost a tenth of the op.

    out, lse = attention(q, rows, slots, scale, d_v)
        q     [T, H, D] bf16             the queries (absorbed MLA: D = kv_lora + rope dims)
        rows  [num_slots, D] bf16        the cache's rows, contiguous in D; V = a row's first d_v dims
        slots [T, topk] int64            the rows each token attends over; -1, or any slot outside 0 .. num_slots - 1,
                                         is no key (that row is never read: no slot value can reach past the rows)
        ->
        out   [T, H, d_v] bf16           softmax(scale * q . rows) @ rows[:, :d_v] over the valid slots, rounded
                                         once (fp32 with out_dtype=torch.float32); 0 for a token without keys
        lse   [T, H] fp32                log of the softmax's sum of exp(scale * q . row) (natural); -inf without keys

    out, lse = paged_attention(q, cache, indices, block_table, seq_lens_k, cu_seqlens_q, scale, d_v)
        the same over the op's own paged batch: cache [num_blocks, block_size, D] bf16 (rows contiguous in D, any
        block / slot strides), indices [T, topk] int32 request-local positions, block_table [B, max_blocks],
        seq_lens_k [B] and cu_seqlens_q [B + 1] int32. The kernel finds each token's sequence and each key's row
        itself, with the tests of glm5_hal.paged.key_slots (a position outside 0 .. seq_lens_k[b] - 1 or the table,
        or a table entry outside the cache, is no key): no slot tensor is made, which at one decode token cost as
        much time in small torch ops as the kernel's own scores.

The arithmetic is the fp32 path's up to the order of the sums: exact bf16 products with fp32 sums for the scores,
an fp32 softmax (shifted by the row maximum, exp to ~1 ulp), and the normalised probabilities as hi + lo bf16 parts
(~2^-16 of each) for the value product. A row whose slot is -1 is never read, so whatever an unused cache slot holds
(NaN) cannot reach a result. The kernel runs on torch's intra-op thread count, split by tokens; the custom op
torch.ops.glm5_hal.native_paged_sparse_attention (the torch backend's route) is what aten-level spies, FakeTensor and
torch.compile see. `attention` is the kernel's flat form over slots: no route calls it, the tests check the kernel's
arithmetic through it against float64 and the paged entry's key lookup against it.

Two C kernels share these entry points: sparse_attention.c (vector builds: AVX-512 BF16, AVX2, portable) and, for the
AMX build, amx_attention.c (both products as tile GEMMs, the same softmax; its bf16 inputs are read with the tile
instruction's DAZ and its fp32 sums flushed below 1.2e-38, backends/torch_eager/native/amx_tiles.h). `isa` picks the
build and, by default, the kernel (kernel_for); `kernel=AMX_KERNEL, isa=PORTABLE` runs the AMX blocking on any CPU.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from backends.torch_eager.native import amx_tiles
from backends.torch_eager.native import threads as threads_
from backends.torch_eager.native.row_prefetch import ROW_PREFETCHES, check_prefetch
from glm5_hal.checks import check
from glm5_hal.ops.common import plain_eager
from glm5_hal.paged import slot_rows

FAST = "avx512_bf16"
AVX2 = "avx2"  # 256-bit FMA on exactly widened bf16, P in fp32 for the values: CPUs without AVX-512
AMX = "amx"  # the AMX kernel's build (AMX_KERNEL: both products on tiles)
PORTABLE = "portable"
KERNEL = "sparse_attention"  # sparse_attention.c: the vector builds (FAST, AVX2, PORTABLE)
AMX_KERNEL = "amx_attention"  # amx_attention.c: the same entry points on AMX tiles (AMX, PORTABLE: its blocking)
# How the kernel asks for the rows it reads next where nothing measured it (row_prefetch.py: ROW_PREFETCHES; the
# torch backend's probe measures which is fastest here, the results are the same bits).
DEFAULT_PREFETCH = "l2"

_L, _P, _F, _I = ctypes.c_long, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_HEAD = [_L, _L, _L, _L, _P, _L, _L, _P, _L, _L]  # heads, dims, dv, topk, q, its strides, rows, num_slots, row_stride
# scale, out, out_fp32, out strides, lse, lse stride, row prefetch (ROW_PREFETCHES), token range
_TAIL = [_F, _P, _I, _L, _L, _P, _L, _I, _L, _L]
_ARGTYPES = [*_HEAD, _P, *_TAIL]  # slots
# indices, index stride, block table, its stride, max_blocks, seq_lens_k, cu_seqlens_q, B, block_size, num_blocks,
# block_step, row_step
_PAGED_ARGTYPES = [*_HEAD, _P, _L, _P, _L, _L, _P, _P, _L, _L, _L, _L, _L, *_TAIL]
_OUT_DTYPES = (torch.bfloat16, torch.float32)


def kernel_for(isa: str, kernel: str | None = None) -> str:
    """The C kernel that runs for `isa`: `kernel` where given (KERNEL or AMX_KERNEL), else AMX_KERNEL for the AMX
    build and KERNEL for the others."""
    return amx_tiles.source_for(isa, KERNEL, AMX_KERNEL, kernel)


def _kernel(isa: str, paged: bool = False, kernel: str | None = None):
    name, argtypes = ("glm5_sparse_attention_paged", _PAGED_ARGTYPES) if paged else ("glm5_sparse_attention", _ARGTYPES)
    return amx_tiles.any_function(kernel_for(isa, kernel), isa, name, argtypes, ctypes.c_int)


def availability(isa: str = FAST, kernel: str | None = None) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel (kernel_for) built for `isa` here (built on first use;
    for the AMX kernel, Linux's grant of the tile state included)."""
    return amx_tiles.any_availability(kernel_for(isa, kernel), isa)


def _check_prefetch(prefetch: str) -> None:
    check_prefetch("sparse attention", prefetch)


def _check_query(q: Tensor) -> tuple[int, int]:
    """q [T, H, D] bf16; returns (T, D)."""
    check(
        q.dim() == 3 and q.dtype == torch.bfloat16,
        TypeError,
        lambda: f"q: expected [T, H, D] bf16, got {tuple(q.shape)} {q.dtype}",
    )
    return q.shape[0], q.shape[2]


def _check_arguments(q: Tensor, rows: Tensor, slots: Tensor, d_v: int, out_dtype: torch.dtype) -> None:
    tokens, dims = _check_query(q)
    check(
        rows.dim() == 2 and rows.dtype == torch.bfloat16 and rows.stride(1) == 1,
        TypeError,
        lambda: f"rows: expected [num_slots, D] bf16 with contiguous rows, got {tuple(rows.shape)} {rows.dtype}",
    )
    check(rows.shape[1] == dims, ValueError, lambda: f"rows: expected {dims} wide (q's D), got {rows.shape[1]}")
    check(
        slots.dim() == 2 and slots.shape[0] == tokens and slots.dtype == torch.int64,
        TypeError,
        lambda: f"slots: expected [{tokens}, topk] int64, got {tuple(slots.shape)} {slots.dtype}",
    )
    _check_common(dims, d_v, out_dtype, q=q, rows=rows, slots=slots)


def _check_common(dims: int, d_v: int, out_dtype: torch.dtype, **tensors: Tensor) -> None:
    check(0 <= d_v <= dims, ValueError, lambda: f"d_v: expected 0 .. {dims}, got {d_v}")
    check(out_dtype in _OUT_DTYPES, TypeError, lambda: f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    for name, t in tensors.items():
        check(t.device.type == "cpu", ValueError, lambda t=t, n=name: f"{n}: expected a CPU tensor, got {t.device}")


def _check_paged_arguments(
    q: Tensor,
    cache: Tensor,
    indices: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    d_v: int,
    out_dtype: torch.dtype,
) -> None:
    tokens, dims = _check_query(q)
    check(
        cache.dim() == 3 and cache.dtype == torch.bfloat16 and cache.stride(2) == 1,
        TypeError,
        lambda: (
            f"cache: expected [num_blocks, block_size, D] bf16 with contiguous rows, got {tuple(cache.shape)} "
            f"{cache.dtype} strides {cache.stride()}"
        ),
    )
    check(cache.shape[2] == dims, ValueError, lambda: f"cache: expected {dims} wide (q's D), got {cache.shape[2]}")
    check(
        indices.dim() == 2 and indices.shape[0] == tokens and indices.dtype == torch.int32,
        TypeError,
        lambda: f"indices: expected [{tokens}, topk] int32, got {tuple(indices.shape)} {indices.dtype}",
    )
    check(
        block_table.dim() == 2 and block_table.dtype == torch.int32,
        TypeError,
        lambda: f"block_table: expected [B, max_blocks] int32, got {tuple(block_table.shape)} {block_table.dtype}",
    )
    batch = block_table.shape[0]
    for name, t, size in (("seq_lens_k", seq_lens_k, batch), ("cu_seqlens_q", cu_seqlens_q, batch + 1)):
        check(
            t.shape == (size,) and t.dtype == torch.int32,
            TypeError,
            lambda t=t, n=name, s=size: f"{n}: expected [{s}] int32, got {tuple(t.shape)} {t.dtype}",
        )
    _check_common(
        dims,
        d_v,
        out_dtype,
        q=q,
        cache=cache,
        indices=indices,
        block_table=block_table,
        seq_lens_k=seq_lens_k,
        cu_seqlens_q=cu_seqlens_q,
    )


def _attention(
    q: Tensor,
    rows: Tensor,
    slots: Tensor,
    scale: float,
    d_v: int,
    out_dtype: torch.dtype,
    isa: str,
    threads: int | None,
    kernel: str | None = None,
    prefetch: str = DEFAULT_PREFETCH,
) -> tuple[Tensor, Tensor]:
    slots = slots.contiguous()
    function = _kernel(isa, kernel=kernel)
    return _run(function, q, rows, (slots.data_ptr(),), slots.shape[1], scale, d_v, out_dtype, threads, prefetch)


def _run(
    kernel,
    q: Tensor,
    rows: Tensor,
    keys: tuple[int, ...],
    topk: int,
    scale: float,
    d_v: int,
    out_dtype: torch.dtype,
    threads: int | None,
    prefetch: str,
) -> tuple[Tensor, Tensor]:
    """The kernel over every token, split by tokens across threads; `keys`: the arguments that say where each
    token's rows are (the slots, or the paged batch; the caller keeps their tensors alive)."""
    tokens, heads, dims = q.shape
    out = torch.empty(tokens, heads, d_v, dtype=out_dtype)
    lse = torch.empty(tokens, heads, dtype=torch.float32)
    if lse.numel() == 0:
        return out, lse
    q = q if q.stride(2) == 1 else q.contiguous()  # the kernel packs each token's heads from rows of contiguous dims
    args = (heads, dims, d_v, topk, q.data_ptr(), q.stride(0), q.stride(1), rows.data_ptr(), rows.shape[0])
    args += (rows.stride(0), *keys, scale)
    args += (out.data_ptr(), int(out_dtype == torch.float32), out.stride(0), out.stride(1), lse.data_ptr(), heads)
    args += (ROW_PREFETCHES[prefetch],)
    flops = 2 * tokens * topk * heads * (dims + d_v)
    shares = threads_.split(tokens, threads_.thread_count(flops, threads))
    failed = threads_.failed_shares(kernel, args, shares)
    check(not failed, MemoryError, lambda: f"sparse attention: no memory for the workspace of {topk} keys")
    return out, lse


def _paged_attention(
    q: Tensor,
    cache: Tensor,
    indices: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    d_v: int,
    out_dtype: torch.dtype,
    isa: str,
    threads: int | None,
    kernel: str | None = None,
    prefetch: str = DEFAULT_PREFETCH,
) -> tuple[Tensor, Tensor]:
    view = slot_rows(cache)  # the cache's rows in place, whatever its block and slot strides
    # Rows of the index tensors are read at their stride; each row itself must be contiguous.
    indices = indices if indices.stride(1) == 1 else indices.contiguous()
    table = block_table if block_table.stride(1) == 1 or block_table.shape[1] <= 1 else block_table.contiguous()
    seq_lens_k, cu_seqlens_q = seq_lens_k.contiguous(), cu_seqlens_q.contiguous()
    keys = (indices.data_ptr(), indices.stride(0), table.data_ptr(), table.stride(0), table.shape[1])
    keys += (seq_lens_k.data_ptr(), cu_seqlens_q.data_ptr(), table.shape[0], cache.shape[1], cache.shape[0])
    keys += (view.block_step, view.row_step)
    function = _kernel(isa, paged=True, kernel=kernel)
    return _run(function, q, view.rows, keys, indices.shape[1], scale, d_v, out_dtype, threads, prefetch)


def attention(
    q: Tensor,
    rows: Tensor,
    slots: Tensor,
    scale: float,
    d_v: int,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    isa: str = FAST,
    threads: int | None = None,
    kernel: str | None = None,
    prefetch: str = DEFAULT_PREFETCH,
) -> tuple[Tensor, Tensor]:
    """(out, lse) as described in the module docstring. out_dtype: bf16 (the op's) or fp32 (the unrounded result,
    for tests). isa: the build (backends.torch_eager.native.build.ISAS). threads: default torch's. kernel: KERNEL or
    AMX_KERNEL (default: kernel_for(isa); the tests run AMX_KERNEL's portable build, its blocking on any CPU).
    prefetch: how the kernel asks for the rows it reads next (ROW_PREFETCHES; the same results, at another speed)."""
    _check_arguments(q, rows, slots, d_v, out_dtype)
    _check_prefetch(prefetch)
    return _attention(q, rows, slots, scale, d_v, out_dtype, isa, threads, kernel, prefetch)


def paged_attention(
    q: Tensor,
    cache: Tensor,
    indices: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    d_v: int,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    isa: str = FAST,
    threads: int | None = None,
    validated: bool = False,
    kernel: str | None = None,
    prefetch: str = DEFAULT_PREFETCH,
) -> tuple[Tensor, Tensor]:
    """(out, lse) as `attention`, over the op's paged batch (module docstring). isa, threads, out_dtype, kernel,
    prefetch: as `attention`. validated: the caller has established what this would check (the kinds and shapes of
    every argument, bf16 q and cache with contiguous rows, CPU tensors, the prefetch name): the torch backend, behind
    glm5_hal.sparse_flash_attention's validation and its native route's conditions (a decode step otherwise runs
    every check twice, ~0.02 ms a layer inside an engine). The kernel itself drops keys whose block or position
    the table and cache do not hold."""
    if not validated:
        _check_paged_arguments(q, cache, indices, block_table, seq_lens_k, cu_seqlens_q, d_v, out_dtype)
        _check_prefetch(prefetch)
    # The build is an argument of the op: compile sees each; in plain eager mode the implementation runs directly.
    if threads is None and out_dtype == torch.bfloat16 and not plain_eager((q, cache, indices)):
        return torch.ops.glm5_hal.native_paged_sparse_attention(
            q, cache, indices, block_table, seq_lens_k, cu_seqlens_q, scale, d_v, isa, kernel_for(isa, kernel), prefetch
        )
    return _paged_attention(
        q, cache, indices, block_table, seq_lens_k, cu_seqlens_q, scale, d_v, out_dtype, isa, threads, kernel, prefetch
    )


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define(
    "native_paged_sparse_attention(Tensor q, Tensor cache, Tensor indices, Tensor block_table, Tensor seq_lens_k, "
    f"Tensor cu_seqlens_q, float scale, int d_v, str isa='{FAST}', str kernel='{KERNEL}', "
    f"str prefetch='{DEFAULT_PREFETCH}') -> (Tensor, Tensor)"
)
_LIBRARY.impl(
    "native_paged_sparse_attention",
    lambda q, cache, indices, table, lens, cu, scale, d_v, isa=FAST, kernel=KERNEL, prefetch=DEFAULT_PREFETCH: (
        _paged_attention(q, cache, indices, table, lens, cu, scale, d_v, torch.bfloat16, isa, None, kernel, prefetch)
    ),
    "CPU",
)


@torch.library.register_fake("glm5_hal::native_paged_sparse_attention")
def _fake_paged_attention(
    q: Tensor,
    cache: Tensor,
    indices: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    d_v: int,
    isa: str = FAST,
    kernel: str = KERNEL,
    prefetch: str = DEFAULT_PREFETCH,
) -> tuple[Tensor, Tensor]:
    tokens, heads, _ = q.shape
    return q.new_empty(tokens, heads, d_v), q.new_empty(tokens, heads, dtype=torch.float32)
