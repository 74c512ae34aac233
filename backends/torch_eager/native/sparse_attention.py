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

The arithmetic is the fp32 path's up to the order of the sums: exact bf16 products with fp32 sums for the scores,
an fp32 softmax (shifted by the row maximum, exp to ~1 ulp), and the normalised probabilities as hi + lo bf16 parts
(~2^-16 of each) for the value product. A row whose slot is -1 is never read, so whatever an unused cache slot holds
(NaN) cannot reach a result. The kernel runs on torch's intra-op thread count, split by tokens; the custom op
torch.ops.glm5_hal.native_sparse_attention is what aten-level spies, FakeTensor and torch.compile see.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from backends.torch_eager.native import build
from backends.torch_eager.native import threads as threads_
from backends.torch_eager.native.packing import head_pairs
from glm5_hal.checks import check

FAST = "avx512_bf16"
AVX2 = "avx2"  # 256-bit FMA on exactly widened bf16, P in fp32 for the values: CPUs without AVX-512
PORTABLE = "portable"

_L, _P, _F, _I = ctypes.c_long, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_ARGTYPES = [_L, _L, _L, _L, _P, _P, _L, _L, _P, _F, _P, _I, _L, _L, _P, _L, _L, _L]
_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _kernel(isa: str):
    return build.function("sparse_attention", isa, "glm5_sparse_attention", _ARGTYPES, ctypes.c_int)


def availability(isa: str = FAST) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel built for `isa` here (built on first use)."""
    return build.availability("sparse_attention", isa)


def _check_arguments(q: Tensor, rows: Tensor, slots: Tensor, d_v: int, out_dtype: torch.dtype) -> None:
    check(
        q.dim() == 3 and q.dtype == torch.bfloat16,
        TypeError,
        lambda: f"q: expected [T, H, D] bf16, got {tuple(q.shape)} {q.dtype}",
    )
    tokens, _, dims = q.shape
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
    check(0 <= d_v <= dims, ValueError, lambda: f"d_v: expected 0 .. {dims}, got {d_v}")
    check(out_dtype in _OUT_DTYPES, TypeError, lambda: f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    for name, t in (("q", q), ("rows", rows), ("slots", slots)):
        check(t.device.type == "cpu", ValueError, lambda t=t, n=name: f"{n}: expected a CPU tensor, got {t.device}")


def _attention(
    q: Tensor,
    rows: Tensor,
    slots: Tensor,
    scale: float,
    d_v: int,
    out_dtype: torch.dtype,
    isa: str,
    threads: int | None,
) -> tuple[Tensor, Tensor]:
    tokens, heads, dims = q.shape
    topk = slots.shape[1]
    out = torch.empty(tokens, heads, d_v, dtype=out_dtype)
    lse = torch.empty(tokens, heads, dtype=torch.float32)
    if lse.numel() == 0:
        return out, lse
    packed, slots = head_pairs(q), slots.contiguous()
    args = (heads, dims, d_v, topk, packed.data_ptr(), rows.data_ptr(), rows.shape[0], rows.stride(0))
    args += (slots.data_ptr(), scale)
    args += (out.data_ptr(), int(out_dtype == torch.float32), out.stride(0), out.stride(1), lse.data_ptr(), heads)
    flops = 2 * tokens * topk * heads * (dims + d_v)
    shares = threads_.split(tokens, threads_.thread_count(flops, threads))
    failed = threads_.failed_shares(_kernel(isa), args, shares)
    check(not failed, MemoryError, lambda: f"sparse attention: no memory for the workspace of {topk} keys")
    return out, lse


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
) -> tuple[Tensor, Tensor]:
    """(out, lse) as described in the module docstring. out_dtype: bf16 (the op's) or fp32 (the unrounded result,
    for tests). isa: the build (backends.torch_eager.native.build.ISAS). threads: default torch's."""
    _check_arguments(q, rows, slots, d_v, out_dtype)
    if threads is None and out_dtype == torch.bfloat16:  # the build is an argument of the op: compile sees each
        return torch.ops.glm5_hal.native_sparse_attention(q, rows, slots, scale, d_v, isa)
    return _attention(q, rows, slots, scale, d_v, out_dtype, isa, threads)


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define(
    f"native_sparse_attention(Tensor q, Tensor rows, Tensor slots, float scale, int d_v, str isa='{FAST}') "
    "-> (Tensor, Tensor)"
)
_LIBRARY.impl(
    "native_sparse_attention",
    lambda q, rows, slots, scale, d_v, isa=FAST: _attention(q, rows, slots, scale, d_v, torch.bfloat16, isa, None),
    "CPU",
)


@torch.library.register_fake("glm5_hal::native_sparse_attention")
def _fake_attention(
    q: Tensor, rows: Tensor, slots: Tensor, scale: float, d_v: int, isa: str = FAST
) -> tuple[Tensor, Tensor]:
    tokens, heads, _ = q.shape
    return q.new_empty(tokens, heads, d_v), q.new_empty(tokens, heads, dtype=torch.float32)
