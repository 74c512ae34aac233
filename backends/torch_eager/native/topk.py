"""The deterministic top-k of fp32 score rows on CPUs (topk.c): glm5_hal.topk's contract, the best k columns of
each row by score descending, equal scores by the LOWER column (NaN above everything, -0.0 tying +0.0), in one
radix select and one radix sort of the k chosen per row.

    values, columns = topk(scores, k)   # scores [N, S] fp32 on the CPU, any strides; 0 <= k <= S
                                        # -> values [N, k] fp32 (the row's own bits), columns [N, k] int64

Plain C with no instruction-set needs (built as backends.torch_eager.native.build's "portable"). Runs on torch's
intra-op thread count, split by rows; the custom op torch.ops.glm5_hal.native_topk is what aten-level spies, FakeTensor
and torch.compile see.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from backends.torch_eager.native import build
from backends.torch_eager.native import threads as threads_
from glm5_hal.checks import check
from glm5_hal.ops.common import plain_eager

ISA = "portable"  # the only build: plain C (radix passes over memory; intrinsics would add little)
MAX_WIDTH = (1 << 31) - 1  # topk.c keeps columns in 32 bits
# threads.thread_count's "flops" per score: a row of 16K scores takes ~33 us on one core, about what a thread's
# share must cost (MIN_FLOPS_PER_THREAD) before handing it to the pool pays.
WORK_PER_SCORE = 128

_L, _P = ctypes.c_long, ctypes.c_void_p
_ARGTYPES = [_L, _L, _P, _L, _L, _P, _P, _L, _L]


def _kernel(positions: bool = False):
    name = "glm5_topk_positions" if positions else "glm5_topk"
    return build.function("topk", ISA, name, _ARGTYPES, ctypes.c_int)


def availability() -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel here (built on first use)."""
    return build.availability("topk", ISA)


def _run(scores: Tensor, k: int, threads: int | None, positions: bool = False) -> tuple[Tensor, Tensor]:
    rows, width = scores.shape
    values = torch.empty(rows, k, dtype=torch.float32)
    columns = torch.empty(rows, k, dtype=torch.int32 if positions else torch.int64)
    if values.numel() == 0:
        return values, columns
    args = (width, k, scores.data_ptr(), scores.stride(0), scores.stride(1), values.data_ptr(), columns.data_ptr())
    shares = threads_.split(rows, threads_.thread_count(WORK_PER_SCORE * rows * width, threads))
    failed = threads_.failed_shares(_kernel(positions), args, shares)
    check(not failed, MemoryError, lambda: f"native top-k: no memory for the scratch of a row of {width} scores")
    return values, columns


def topk(scores: Tensor, k: int, *, threads: int | None = None) -> tuple[Tensor, Tensor]:
    """(values, columns) as described in the module docstring. threads: default torch's."""
    _check_scores(scores, k)
    if threads is None and not plain_eager((scores,)):  # what sees ops (spies, FakeTensor, compile) sees this one
        return torch.ops.glm5_hal.native_topk(scores, k)
    return _run(scores, k, threads)


def positions(scores: Tensor, k: int, *, threads: int | None = None) -> tuple[Tensor, Tensor]:
    """(values, positions): `topk`'s values, and its columns as int32 [N, k] with -1 where the value is -inf (what
    the indexer returns: a key no token can see is no key), made by the kernel as it writes the columns."""
    _check_scores(scores, k)
    if threads is None and not plain_eager((scores,)):
        return torch.ops.glm5_hal.native_topk_positions(scores, k)
    return _run(scores, k, threads, positions=True)


def _check_scores(scores: Tensor, k: int) -> None:
    check(
        scores.dim() == 2 and scores.dtype == torch.float32 and scores.device.type == "cpu",
        TypeError,
        lambda: f"scores: expected [N, S] fp32 on the CPU, got {tuple(scores.shape)} {scores.dtype} on {scores.device}",
    )
    width = scores.shape[1]
    check(0 <= k <= width, ValueError, lambda: f"k: expected 0 .. {width} (the row width), got {k}")
    check(width <= MAX_WIDTH, ValueError, lambda: f"scores: expected rows of at most {MAX_WIDTH} scores, got {width}")


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define("native_topk(Tensor scores, int k) -> (Tensor, Tensor)")
_LIBRARY.impl("native_topk", lambda scores, k: _run(scores, k, None), "CPU")


@torch.library.register_fake("glm5_hal::native_topk")
def _fake(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    rows = scores.shape[0]
    return scores.new_empty(rows, k, dtype=torch.float32), scores.new_empty(rows, k, dtype=torch.int64)


_LIBRARY.define("native_topk_positions(Tensor scores, int k) -> (Tensor, Tensor)")
_LIBRARY.impl("native_topk_positions", lambda scores, k: _run(scores, k, None, positions=True), "CPU")


@torch.library.register_fake("glm5_hal::native_topk_positions")
def _fake_positions(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    rows = scores.shape[0]
    return scores.new_empty(rows, k, dtype=torch.float32), scores.new_empty(rows, k, dtype=torch.int32)
