"""Conventions vendor kernels use where the contract (docs/ops.md) uses another, converted once for every vendor
backend at its edge. Pure tensor functions: no vendor library, no host read.

    vendor kernel                                   glm5-hal contract
    lse in base 2 (FlashMLA-style log2 sum exp2) -> natural-log lse                      lse_from_base2
    per-token int8 scale 0 for an all-zero row   -> scale 1, codes 0; codes 0 for a      contract_quant_scale
      (codes undefined), NaN / inf scale            NaN / inf scale (docs/ops.md "NaN")
    indices with -1 anywhere in a row            -> valid entries first, then -1            valid_first
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
