"""Conventions vendor kernels use where the contract (docs/ops.md) uses another, converted once for every vendor
backend at its edge. Pure tensor functions: no vendor library, no host read.

    vendor kernel                                   glm5-hal contract
    lse in base 2 (FlashMLA-style log2 sum exp2) -> natural-log lse                      lse_from_base2
    per-token int8 scale 0 for an all-zero row   -> scale 1, codes 0; codes 0 for a      contract_quant_scale
      (codes undefined), NaN / inf scale            NaN / inf scale (docs/ops.md "NaN")
    indices with -1 anywhere in a row            -> valid entries first, then -1            valid_first
    softmax row max and sum of exp(score - max)  -> natural-log lse, -inf for an empty row  lse_from_max_and_sum
    scatter index (assignment a sits in row r)  <-> gather index src_index (row r came     invert_permutation
                                                    from assignment a)
    a row with no valid key: out / lse undefined -> out = 0, lse = -inf; a head whose    contract_empty_rows
      or +inf                                       lse is -inf gets out = 0
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LN2 = math.log(2.0)


def lse_from_base2(lse2: Tensor) -> Tensor:
    """[...] log2(sum 2^x) -> [...] fp32 natural-log logsumexp (log(sum e^y) = log2(...) * ln 2); +-inf and NaN
    stay as they are."""
    return lse2.to(torch.float32) * LN2


def contract_quant_scale(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token int8 codes and scales from a vendor quantizer -> the contract's zero-row and NaN rules.

    A kernel computing scale = max|x| / 127 gives 0 for an all-zero row (its codes are then undefined); the
    contract gives such a row scale 1 and codes 0. A row holding NaN or inf has a non-finite scale, and the
    contract gives it codes 0 whatever the kernel wrote (docs/ops.md "NaN"). q: [..., K] int8; scale: [...] fp32.
    """
    zero = scale == 0
    undefined = zero | ~torch.isfinite(scale)
    return q.masked_fill(undefined[..., None], 0), torch.where(zero, torch.ones_like(scale), scale)


def contract_empty_rows(out: Tensor, lse: Tensor, empty: Tensor) -> tuple[Tensor, Tensor]:
    """Sparse attention's edge rules on a kernel's result: out [T, H, d_v], lse [T, H] fp32 natural, empty [T]
    bool (a token without any valid index, whose result kernels leave undefined). Such a token gets lse = -inf,
    and every head whose lse is -inf (no key, or only -inf scores: an empty softmax) gets out = 0."""
    lse = lse.masked_fill(empty[:, None], float("-inf"))
    return out.masked_fill((lse == float("-inf"))[..., None], 0), lse


def valid_first(indices: Tensor, valid: Tensor) -> Tensor:
    """[T, k] indices with `valid` [T, k] -> the valid entries of each row first (in their order), then -1."""
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    moved = indices.gather(1, order)
    return torch.where(valid.gather(1, order), moved, torch.full_like(moved, -1))


def lse_from_max_and_sum(row_max: Tensor, row_sum: Tensor) -> Tensor:
    """[...] softmax statistics (max of the scores, sum of exp(score - max)) -> [...] fp32 natural-log lse.

    A row whose sum is 0 (no valid key: whatever the kernel left in its max) or whose max is -inf (only -inf scores,
    an empty softmax) gets -inf, the log of an empty sum; a NaN sum (a NaN score) stays NaN (docs/ops.md "NaN").
    """
    lse = row_max.to(torch.float32) + torch.log(row_sum.to(torch.float32))
    # A max of -inf: the kernel's sum exp(score - max) may be NaN there (-inf - -inf), the contract's lse is -inf.
    empty = (row_sum == 0) | (row_max == float("-inf"))
    return torch.where(empty, torch.full_like(lse, float("-inf")), lse)


def invert_permutation(perm: Tensor) -> Tensor:
    """[M] permutation of 0..M-1 -> its inverse (same dtype): inverse[perm[r]] = r. Turns the contract's src_index
    (row r came from assignment a) into the scatter index kernels take (assignment a sits in row r), and back."""
    inverse = torch.empty_like(perm)
    inverse[perm.to(torch.int64)] = torch.arange(perm.shape[0], dtype=perm.dtype, device=perm.device)
    return inverse
