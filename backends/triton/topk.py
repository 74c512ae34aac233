"""Top-k of score rows on the GPU, in the contract's order: the best k columns, equal scores by the LOWER column.

glm5_hal.topk gives the same answer in torch ops (a float select of k + 1, a sort of those, a composite select for
rows with a tie across the boundary, and a flag read back to the host to decide that). On an H200 those ops took
40-61% of the Triton lightning_indexer at decode (64 tokens over 64K keys, docs/backends.md); here one program per
row does the whole of it:

[radix select]  the row's scores as int32 keys in float order (`ordered_key`: -0.0 folded into +0.0, every NaN one
                key above +inf, negatives' magnitude bits flipped); 4 passes of 8 bits, each a histogram of the next
                digit of the keys that share the digits chosen so far, find the k-th largest key exactly: `kth`,
                with `above` keys larger and `k - above` of the keys equal to it to take (the lowest columns).
[collect]       one more pass writes the k winners' composite keys (key * 2^32 + 2^32 - 1 - column, unique in a row,
                larger for a better (score, lower column)) to a workspace row: the larger keys in slots 0 .. above-1
                and the equal ones by column in the slots after, each by a running count (a cumulative sum per chunk).
[sort]          the k composite keys sorted in registers (tl.sort, descending), decoded to columns; each score read
                back from the row (its own bits: -0.0 and a NaN's payload as they were), and the column written as
                -1 where the score is -inf (lightning_indexer's rule for keys a token cannot see).

The same values and columns in the same order as glm5_hal.topk.topk_lower_position_ties, bit for bit (tested), with
nothing read back to the host. The workspace row is written and read by the same program, ordered by a barrier.
k is at most MAX_K (the sort holds the k keys in registers); lightning_indexer takes glm5_hal.topk beyond that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Keys per chunk of a pass over the row; the histogram's bins (one 8-bit digit).
_BLOCK = 2048
_BINS = 256
# Largest k the kernel sorts in registers (a power of two; GLM-5 and DeepSeek-V3.2 select 2048).
MAX_K = 4096


@triton.jit
def ordered_key(scores):
    """fp32 scores -> int32 keys, larger for a larger score: -0.0 ties +0.0, every NaN is one key above +inf."""
    bits = (scores + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0 (round to nearest)
    bits = tl.where(scores != scores, 0x7FC00000, bits)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: a larger magnitude becomes a smaller integer


@triton.jit
def _next_digit(row_ptr, width, kth, wanted, SHIFT: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """One pass of the radix select: kth's digit at SHIFT (the bits above it already chosen), from a histogram of
    that digit over the row's keys whose bits above it equal kth's (the top digit offset by 128, so that it orders
    as the signed key does) -> (kth with that digit, how many keys equal to kth's digits so far are still to take)."""
    counts = tl.zeros((BINS,), tl.int32)
    for start in range(0, width, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        inside = columns < width
        key = ordered_key(tl.load(row_ptr + columns, mask=inside, other=0.0))
        if SHIFT == 24:
            digit = (key >> 24) + 128
            match = inside
        else:
            digit = (key >> SHIFT) & 0xFF
            match = inside & ((key >> (SHIFT + 8)) == (kth >> (SHIFT + 8)))
        counts += tl.histogram(digit, BINS, mask=match)
    bins = tl.arange(0, BINS)
    at_least = tl.cumsum(counts, 0, reverse=True)  # keys whose digit is >= each bin's
    larger = at_least - counts
    # The digit whose bin holds the wanted-th largest key (an empty bin never qualifies: larger == at_least there).
    digit = tl.max(tl.where((larger < wanted) & (at_least >= wanted), bins, -1), axis=0)
    wanted -= tl.sum(tl.where(bins == digit, larger, 0), axis=0)
    if SHIFT == 24:
        kth = (digit - 128) << 24
    else:
        kth = kth | (digit << SHIFT)
    return kth, wanted


@triton.jit
def _select_kernel(
    scores_ptr,  # [rows, width] fp32
    workspace_ptr,  # [rows, BLOCK_K] int64, scratch
    values_ptr,  # [rows, k] fp32, written
    columns_ptr,  # [rows, k] int32, written: -1 where the value is -inf
    width,
    k,
    stride_sr,
    stride_vr,
    stride_cr,
    BLOCK: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= k, a power of two
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * stride_sr
    # [radix select] kth: the k-th largest key, digit by digit; wanted: how many of the keys that share its digits
    # so far are still to take.
    kth, wanted = _next_digit(row_ptr, width, 0, k, 24, BLOCK, BINS)
    kth, wanted = _next_digit(row_ptr, width, kth, wanted, 16, BLOCK, BINS)
    kth, wanted = _next_digit(row_ptr, width, kth, wanted, 8, BLOCK, BINS)
    kth, wanted = _next_digit(row_ptr, width, kth, wanted, 0, BLOCK, BINS)
    # [collect] the larger keys first, then `wanted` equal ones by column.
    above = k - wanted
    workspace_row = workspace_ptr + row * BLOCK_K
    taken_above = 0
    taken_equal = 0
    for start in range(0, width, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        inside = columns < width
        key = ordered_key(tl.load(row_ptr + columns, mask=inside, other=0.0))
        is_above = inside & (key > kth)
        is_equal = inside & (key == kth)
        slot_above = taken_above + tl.cumsum(is_above.to(tl.int32), 0) - 1
        rank_equal = taken_equal + tl.cumsum(is_equal.to(tl.int32), 0) - 1
        slot = tl.where(is_above, slot_above, above + rank_equal)
        keep = is_above | (is_equal & (rank_equal < wanted))
        composite = key.to(tl.int64) * 4294967296 + (4294967295 - columns.to(tl.int64))
        tl.store(workspace_row + slot, composite, mask=keep)
        taken_above += tl.sum(is_above.to(tl.int32), axis=0)
        taken_equal += tl.sum(is_equal.to(tl.int32), axis=0)
    tl.debug_barrier()  # the workspace row's stores before its loads (other threads of this program made them)
    # [sort] the k winners, best first.
    slots = tl.arange(0, BLOCK_K)
    filled = slots < k
    composite = tl.load(workspace_row + slots, mask=filled, other=-9223372036854775807 - 1)
    composite = tl.sort(composite, descending=True)
    columns = (4294967295 - (composite & 4294967295)).to(tl.int32)
    values = tl.load(row_ptr + columns, mask=filled, other=float("-inf"))
    tl.store(values_ptr + row * stride_vr + slots, values, mask=filled)
    tl.store(columns_ptr + row * stride_cr + slots, tl.where(values == float("-inf"), -1, columns), mask=filled)


def select_topk(scores: Tensor, k: int, values: Tensor, columns: Tensor) -> None:
    """The top-k columns of each row of scores [N, S] fp32 (unit stride along a row; 1 <= k <= min(S, MAX_K)),
    best first, equal scores by the lower column, into values [N, >= k] fp32 (their scores) and columns [N, >= k]
    int32 (-1 where the score is -inf), both with unit stride along the row; only the first k columns are written.
    """
    num_rows, width = scores.shape
    if not 1 <= k <= min(width, MAX_K):
        raise ValueError(f"k: expected 1 <= k <= min(row width {width}, {MAX_K}), got {k}")
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores: expected fp32 rows of unit stride, got {scores.dtype} strides {scores.stride()}")
    if num_rows == 0:
        return
    block_k = triton.next_power_of_2(k)
    workspace = torch.empty((num_rows, block_k), dtype=torch.int64, device=scores.device)
    _select_kernel[(num_rows,)](
        scores,
        workspace,
        values,
        columns,
        width,
        k,
        scores.stride(0),
        values.stride(0),
        columns.stride(0),
        BLOCK=_BLOCK,
        BINS=_BINS,
        BLOCK_K=block_k,
        num_warps=8,
    )
