"""Deterministic top-k of score rows: the best `k` columns, equal scores ranked by the LOWER column.

torch.topk does not say which of several equal scores it returns, and its choice differs between devices,
kernels (radix select vs sort) and even row lengths, so an indexer built on it can pick different keys run after
run or rank after rank when scores tie. The contract (OPS.md section 7, "Top-k ties") fixes the set: rank by
score, then by lower key position.

The rule is enforced by ranking a composite integer key that is unique per column, so any top-k algorithm
returns the same set (and, sorted, the same order):

    key = order(score) * 2^32 + (2^32 - 1 - column)          (int64)

where order(score) is the fp32 bit pattern made monotone (-0.0 folded into +0.0 first, negatives' magnitude
bits flipped), so integer order is float order with -inf lowest and NaN highest (torch.topk's NaN order).
One elementwise pass and a topk over int64: no sort of the whole row, the same select torch uses for floats.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOW_BITS = 1 << 32  # columns below 2^32: a row of up to 4G keys


def ordered_key(scores: Tensor) -> Tensor:
    """[..., S] fp32 -> int64 keys, larger for a better (score, lower column); unique within a row."""
    # + 0.0 turns -0.0 into +0.0 (IEEE round-to-nearest), so the two zeros tie and the position decides.
    bits = (scores.to(torch.float32) + 0.0).view(torch.int32)
    monotone = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: larger magnitude -> smaller integer
    columns = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return monotone.to(torch.int64) * _LOW_BITS + (_LOW_BITS - 1 - columns)


def topk_lower_position_ties(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The top-k columns of each row of scores [N, S] fp32 (k <= S), best first; equal scores by lower column.

    Returns (values [N, k] fp32, columns [N, k] int64): the same for every call, device and row layout.
    """
    columns = torch.topk(ordered_key(scores), k, dim=-1, sorted=True).indices
    return scores.gather(-1, columns), columns
