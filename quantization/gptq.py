"""GPTQ (Frantar et al. 2022): quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized through the inverse Hessian of the layer's reconstruction loss.

    H = 2/n sum_x x^T x  [K, K]   (calibration activations x [K] that the layer reads)
    H += percdamp * mean(diag H) * I;  U = chol(H^-1)^T (upper)
    for each column j:  q_j = quant(w_j);  e = (w_j - q_j) / U[j, j];  W[:, j+1:] -= e U[j, j+1:]

The updates are applied lazily per block of `block_size` columns (one [N, B] x [B, K-rest] product per block).
`act_order` visits columns by decreasing diag(H); scales are then fixed up front from the whole weight (so
groups stay contiguous along K, the layout w4a8_matmul reads). Without act_order a per-group scale is chosen
when its first column is reached, from the error-updated weights (the original GPTQ behaviour).
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantization.quantizers import QuantizedWeight, WeightQuantSpec, find_scale


class HessianAccumulator:
    """Running H = 2/n sum x^T x over the calibration activations a linear layer reads.

    Args:
        in_features: K, the layer's input width.
    """

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.samples = 0

    def add(self, x: Tensor) -> None:
        """x [..., K] (any float dtype): one batch of activation rows."""
        if x.shape[-1] != self.hessian.shape[0]:
            raise ValueError(f"x: expected a last dim of {self.hessian.shape[0]}, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, x.shape[-1]).to(torch.float64)
        total = self.samples + rows.shape[0]
        # Running mean of 2 x^T x, so the damping (relative to mean diag H) does not depend on the sample count.
        self.hessian.mul_(self.samples / total).add_(rows.T @ rows, alpha=2.0 / total)
        self.samples = total


def _inverse_hessian_factor(hessian: Tensor, percdamp: float) -> Tensor:
    """Upper Cholesky factor of (H + damp I)^-1, float64 [K, K]."""
    k = hessian.shape[0]
    damp = percdamp * float(torch.diagonal(hessian).mean())
    damped = hessian + damp * torch.eye(k, dtype=torch.float64)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(damped))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(
    w: Tensor,
    hessian: Tensor,
    spec: WeightQuantSpec,
    *,
    block_size: int = 128,
    percdamp: float = 0.01,
    act_order: bool = False,
) -> QuantizedWeight:
    """GPTQ-quantize one weight.

    Args:
        w: [N, K], any float dtype. The layer's weight (nn.Linear layout).
        hessian: [K, K]. 2/n sum x^T x of the calibration inputs (HessianAccumulator.hessian).
        spec: bits / group size / MSE clip of the quantizer (the scale search is the RTN one).
        block_size: columns per lazy batch update.
        percdamp: damping, as a fraction of mean(diag H), added to the diagonal.
        act_order: quantize columns in decreasing diag(H) order.

    Returns:
        The QuantizedWeight (codes [N, K] int8, scale [N, G] fp32), in the original column order.
    """
    if w.dim() != 2:
        raise ValueError(f"w: expected a weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian: expected [{k}, {k}] for a weight with K = {k}, got {tuple(hessian.shape)}")
    if not 0 < percdamp < 1:
        raise ValueError(f"percdamp: expected a fraction in (0, 1), got {percdamp}")
    weight = w.to(torch.float64).clone()
    hessian = hessian.to(torch.float64).clone()
    # Inputs that never fire carry no information: their columns quantize to 0 and get a unit curvature.
    dead = torch.diagonal(hessian) == 0
    hessian[dead, dead] = 1.0
    weight[:, dead] = 0.0

    groups = spec.groups(k)
    group_size = k // groups
    static_scales = act_order or spec.group_size is None
    scale = find_scale(weight, spec).to(torch.float32).to(torch.float64) if static_scales else None  # [N, G]
    if scale is None:
        scale = torch.ones(n, groups, dtype=torch.float64)

    perm = torch.argsort(torch.diagonal(hessian), descending=True) if act_order else torch.arange(k)
    weight = weight[:, perm]
    hessian = hessian[perm][:, perm]
    u = _inverse_hessian_factor(hessian, percdamp)
    group_of_column = perm // group_size  # group (in original K order) of each permuted column

    codes = torch.zeros(n, k, dtype=torch.float64)
    # The column loop runs thousands of tiny ops: intra-op threads only add synchronisation (10x slower on a
    # loaded 2-core machine), so it runs on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _quantize_columns(weight, u, codes, scale, spec, group_of_column, group_size, static_scales, block_size)
    finally:
        torch.set_num_threads(threads)
    inverse_perm = torch.argsort(perm)
    return QuantizedWeight(codes[:, inverse_perm].to(torch.int8), scale.to(torch.float32), spec)


def _quantize_columns(
    weight: Tensor,
    u: Tensor,
    codes: Tensor,
    scale: Tensor,
    spec: WeightQuantSpec,
    group_of_column: Tensor,
    group_size: int,
    static_scales: bool,
    block_size: int,
) -> None:
    """GPTQ's loop over (permuted) columns: fills codes [N, K] and, for dynamic groups, scale [N, G] in place;
    weight [N, K] is updated with the propagated errors."""
    k = weight.shape[1]
    groups_of = group_of_column.tolist()
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        block = weight[:, i1:i2].clone()
        errors = torch.zeros_like(block)
        u_block = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = groups_of[col]
            if not static_scales and col % group_size == 0:
                # The group's columns as they are now: the rest of this block, then the not yet visited ones.
                upcoming = torch.cat([block[:, i:], weight[:, i2:]], dim=1)[:, :group_size]
                one_group = WeightQuantSpec(bits=spec.bits, group_size=None, mse_clip=spec.mse_clip)
                scale[:, g] = find_scale(upcoming, one_group)[:, 0].to(torch.float32).to(torch.float64)
            column = block[:, i]
            s = scale[:, g]
            q = torch.clamp(torch.round(column / s), spec.qmin, spec.qmax)
            codes[:, col] = q
            err = (column - q * s) / u_block[i, i]
            block[:, i:] -= err[:, None] * u_block[i, i:][None, :]
            errors[:, i] = err
        weight[:, i2:] -= errors @ u[i1:i2, i2:]
