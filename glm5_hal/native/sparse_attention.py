"""Sparse attention's two products read straight from a paged bf16 latent cache, on CPUs (sparse_attention.c): no
gathered copy of each token's selected rows, and fp32 results of exact bf16 products (the fp32 path's arithmetic
up to the order of the sums). The softmax between them stays with the caller, in fp32.

    s = scores(q, rows, slots, scale)   # q [T, H, D] bf16; rows [num_slots, D] bf16 (the cache's rows);
                                        # slots [T, topk] int64, -1 = no key -> s [T, topk, H] fp32,
                                        # s[t, n, h] = scale * q[t, h] . rows[slots[t, n]], -inf where slots is -1
    o = values(p, rows, slots, d_v)     # p [T, topk, H] fp32 -> o [T, H, d_v] fp32,
                                        # o[t, h] = sum over n with slots[t, n] >= 0 of p[t, n, h] * rows[slot, :d_v]

A row whose slot is -1 is never read, so whatever an unused cache slot holds (NaN) cannot reach a result. Both run
on torch's intra-op thread count, split by tokens; the custom ops torch.ops.glm5_hal.native_sparse_scores and
native_sparse_values are what aten-level spies, FakeTensor and torch.compile see.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from glm5_hal.checks import check
from glm5_hal.native import build
from glm5_hal.native import threads as threads_
from glm5_hal.native.packing import head_pairs

FAST = "avx512_bf16"
PORTABLE = "portable"
VALUE_HEADS = 8  # VALUE_HEADS in sparse_attention.c: o has room for the heads rounded up to a multiple of it

_L, _P, _F = ctypes.c_long, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "glm5_sparse_scores": ([_L, _L, _L, _P, _P, _L, _P, _F, _P, _L, _L, _L, _L], None),
    "glm5_sparse_values": ([_L, _L, _L, _P, _L, _L, _P, _L, _P, _P, _L, _L, _L, _L], ctypes.c_int),
}


def _kernel(name: str, isa: str):
    return build.function("sparse_attention", isa, name, *_SIGNATURES[name])


def availability(isa: str = FAST) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernels built for `isa` here (built on first use)."""
    return build.availability("sparse_attention", isa)


def _check_rows(rows: Tensor, slots: Tensor, tokens: int, topk: int) -> None:
    check(
        rows.dim() == 2 and rows.dtype == torch.bfloat16 and rows.stride(1) == 1,
        TypeError,
        lambda: f"rows: expected [num_slots, D] bf16 with contiguous rows, got {tuple(rows.shape)} {rows.dtype}",
    )
    check(
        tuple(slots.shape) == (tokens, topk) and slots.dtype == torch.int64,
        TypeError,
        lambda: f"slots: expected [{tokens}, {topk}] int64, got {tuple(slots.shape)} {slots.dtype}",
    )
    for name, t in (("rows", rows), ("slots", slots)):
        check(t.device.type == "cpu", ValueError, lambda t=t, n=name: f"{n}: expected a CPU tensor, got {t.device}")


def _token_shares(tokens: int, flops: int, threads: int | None) -> list[tuple[int, int]]:
    return threads_.split(tokens, threads_.thread_count(flops, threads))


def _scores(q: Tensor, rows: Tensor, slots: Tensor, scale: float, isa: str, threads: int | None) -> Tensor:
    tokens, heads, dims = q.shape
    topk = slots.shape[1]
    out = torch.empty(tokens, topk, heads, dtype=torch.float32)
    if out.numel() == 0:
        return out
    packed, slots = head_pairs(q), slots.contiguous()
    args = (heads, dims, topk, packed.data_ptr(), rows.data_ptr(), rows.stride(0), slots.data_ptr(), scale)
    args += (out.data_ptr(), out.stride(0), out.stride(1))
    shares = _token_shares(tokens, 2 * tokens * topk * heads * dims, threads)
    threads_.run_shares(_kernel("glm5_sparse_scores", isa), args, shares)
    return out


def _values(p: Tensor, rows: Tensor, slots: Tensor, d_v: int, isa: str, threads: int | None) -> Tensor:
    tokens, topk, heads = p.shape
    padded = -(-heads // VALUE_HEADS) * VALUE_HEADS
    out = torch.empty(tokens, padded, d_v, dtype=torch.float32)
    if out.numel() == 0:
        return out[:, :heads]
    p, slots = p.contiguous(), slots.contiguous()
    args = (heads, d_v, topk, p.data_ptr(), p.stride(0), p.stride(1), rows.data_ptr(), rows.stride(0))
    args += (slots.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1))
    shares = _token_shares(tokens, 2 * tokens * topk * heads * d_v, threads)
    failed = threads_.failed_shares(_kernel("glm5_sparse_values", isa), args, shares)
    check(not failed, MemoryError, lambda: f"sparse attention values: no memory for the workspace of {topk} keys")
    return out[:, :heads]


def scores(
    q: Tensor, rows: Tensor, slots: Tensor, scale: float, *, isa: str = FAST, threads: int | None = None
) -> Tensor:
    """The scores described in the module docstring. isa: the build (glm5_hal.native.build.ISAS). threads:
    default torch's."""
    check(
        q.dim() == 3 and q.dtype == torch.bfloat16 and q.device.type == "cpu",
        TypeError,
        lambda: f"q: expected [T, H, D] bf16 on the CPU, got {tuple(q.shape)} {q.dtype} on {q.device}",
    )
    _check_rows(rows, slots, q.shape[0], slots.shape[-1] if slots.dim() == 2 else -1)
    check(rows.shape[1] == q.shape[2], ValueError, lambda: f"rows: expected {q.shape[2]} wide, got {rows.shape[1]}")
    if isa == FAST and threads is None:
        return torch.ops.glm5_hal.native_sparse_scores(q, rows, slots, scale)
    return _scores(q, rows, slots, scale, isa, threads)


def values(p: Tensor, rows: Tensor, slots: Tensor, d_v: int, *, isa: str = FAST, threads: int | None = None) -> Tensor:
    """The value product described in the module docstring. isa, threads: as `scores`."""
    check(
        p.dim() == 3 and p.dtype == torch.float32 and p.device.type == "cpu",
        TypeError,
        lambda: f"p: expected [T, topk, H] fp32 on the CPU, got {tuple(p.shape)} {p.dtype} on {p.device}",
    )
    _check_rows(rows, slots, p.shape[0], p.shape[1])
    check(0 <= d_v <= rows.shape[1], ValueError, lambda: f"d_v: expected 0 .. {rows.shape[1]}, got {d_v}")
    if isa == FAST and threads is None:
        return torch.ops.glm5_hal.native_sparse_values(p, rows, slots, d_v)
    return _values(p, rows, slots, d_v, isa, threads)


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define("native_sparse_scores(Tensor q, Tensor rows, Tensor slots, float scale) -> Tensor")
_LIBRARY.define("native_sparse_values(Tensor p, Tensor rows, Tensor slots, int d_v) -> Tensor")
_LIBRARY.impl("native_sparse_scores", lambda q, rows, slots, scale: _scores(q, rows, slots, scale, FAST, None), "CPU")
_LIBRARY.impl("native_sparse_values", lambda p, rows, slots, d_v: _values(p, rows, slots, d_v, FAST, None), "CPU")


@torch.library.register_fake("glm5_hal::native_sparse_scores")
def _fake_scores(q: Tensor, rows: Tensor, slots: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape[0], slots.shape[1], q.shape[1], dtype=torch.float32)


@torch.library.register_fake("glm5_hal::native_sparse_values")
def _fake_values(p: Tensor, rows: Tensor, slots: Tensor, d_v: int) -> Tensor:
    return p.new_empty(p.shape[0], p.shape[2], d_v)
