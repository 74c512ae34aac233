"""Deterministic top-k of score rows: the best `k` columns, equal scores ranked by the LOWER column.

torch.topk does not say which of several equal scores it returns, and its choice differs between devices,
kernels (radix select vs sort) and even row lengths, so an indexer built on it can pick different keys run after
run or rank after rank when scores tie. The contract (OPS.md section 7, "Top-k ties") fixes the set: rank by
score, then by lower key position; here the order of the returned row is fixed the same way.

    torch.topk(scores, k + 1)          the fast float select (unsorted), one column more than asked
      -> the k + 1 sorted by (score, -column): a sort of k + 1 elements, not of the row
      -> the set of the first k is already unique unless the (k+1)-th score equals the k-th (a tie across the
         boundary); only such rows (rare: exact float ties) are selected again over a composite integer key

    composite key = order(score) * 2^32 + (2^32 - 1 - column)          (int64, unique within a row)

order(score) is the fp32 bit pattern made monotone (-0.0 folded into +0.0 first, every NaN made +NaN, negatives'
magnitude bits flipped), so integer order is float order with -inf lowest and NaN highest (the contract's NaN
order, and torch.topk's); NaN ties NaN, so the lower column wins there too.
Deciding whether a row needs the second select reads one flag per row back to the host; where that is not
allowed (CUDA graph capture, torch.compile tracing) every row takes the composite select instead.

This is the torch-ops form every backend can run. The `torch` backend runs CPU fp32 rows on its native kernel
instead where that builds (backends/torch_eager/topk.py): the same values, columns and order, faster at decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_hal.host_reads import host_reads_allowed

_LOW_BITS = 1 << 32  # columns below 2^32: a row of up to 4G keys
_NAN_KEY = 0x7FC00000  # the bits of +NaN: above +inf's 0x7F800000


def ordered_key(scores: Tensor, columns: Tensor | None = None) -> Tensor:
    """[..., S] scores (fp32) at `columns` ([..., S] int, default 0 .. S-1) -> int64 keys, larger for a better
    (score, lower column); unique within a row when the columns are."""
    # + 0.0 turns -0.0 into +0.0 (IEEE round-to-nearest), so the two zeros tie and the column decides.
    values = scores.to(torch.float32) + 0.0
    key = values.view(torch.int32).to(torch.int64)
    # Every NaN, whatever its sign bit (x86's default NaN has it set) and payload, gets one key above +inf.
    key = torch.where(torch.isnan(values), _NAN_KEY, key)
    key ^= (key >> 31) & 0x7FFFFFFF  # negative floats: a larger magnitude becomes a smaller integer
    if columns is None:
        columns = torch.arange(scores.shape[-1], device=scores.device)
    return key.mul_(_LOW_BITS).add_(_LOW_BITS - 1 - columns)


def _composite_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    columns = torch.topk(ordered_key(scores), k, dim=-1, sorted=True).indices
    return scores.gather(-1, columns), columns


def topk_lower_position_ties(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The top-k columns of each row of scores [N, S] fp32 (k <= S), best first; equal scores by lower column.

    Returns (values [N, k] fp32, columns [N, k] int64): the same for every call, device and row layout.
    """
    if not host_reads_allowed(scores):
        return _composite_topk(scores, k)
    return _torch_topk(scores, k)


def _torch_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """topk_lower_position_ties in torch ops: the float select of k + 1, their sort, and the composite select for
    rows with a tie across the boundary."""
    probe = min(k + 1, scores.shape[-1])
    # Unsorted: torch's sorted select costs ~1.5x the select itself at decode (k = 2048 of 16K keys), and the set
    # is put in the contract's order below anyway, by a sort of k + 1 keys (equal scores are common enough among
    # 2048 winners, ~1 row in 6 of random fp32 scores, that ordering only the rows with ties does not pay).
    values, columns = torch.topk(scores, probe, dim=-1, sorted=False)
    order = torch.argsort(ordered_key(values, columns), dim=-1, descending=True)
    values, columns = values.gather(-1, order), columns.gather(-1, order)
    if probe > k:
        kth, next_best = values[:, k - 1], values[:, k]
        # A tie across the boundary leaves the set open; a tie at -inf does not matter (invisible keys become -1).
        open_rows = ((next_best == kth) & (kth > float("-inf"))) | torch.isnan(kth)
        values, columns = values[:, :k], columns[:, :k]
        if bool(open_rows.any()):
            rows = open_rows.nonzero()[:, 0]
            values[rows], columns[rows] = _composite_topk(scores[rows], k)  # in the same order
    return values, columns
