"""Numeric building blocks shared by the op modules: fp32 linear layers, RMSNorm, LayerNorm and RoPE.

Every helper takes fp32 activations and returns fp32: the ops upcast bf16/fp16 inputs once, keep every
intermediate in fp32 (so products accumulate in fp32 and nothing is rounded mid-chain), and cast outputs back to
the input dtype at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

COMPUTE_DTYPE = torch.float32


# Output rows of a bf16/fp16 weight upcast at a time: 256 rows x 7168 x 4 bytes = 7 MiB stays in cache.
WEIGHT_ROWS_PER_UPCAST = 256


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x: [..., in] fp32; weight: [out, in] (nn.Linear layout), any float dtype. Returns x @ weight^T, [..., out]
    fp32, accumulated in fp32."""
    if weight.dtype == COMPUTE_DTYPE or weight.shape[0] <= WEIGHT_ROWS_PER_UPCAST:
        return F.linear(x, weight.to(COMPUTE_DTYPE))
    # Upcasting a whole half-precision weight writes and re-reads a full fp32 copy on every call (100 MB for one
    # GLM-5 expert's w13), which dominates decode; upcasting cache-sized row blocks moves only the weight's own
    # bytes. The arithmetic per output is unchanged.
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    # One fp32 block buffer for all blocks: one allocation per call instead of one multi-MB allocation per block.
    block = x.new_empty(min(WEIGHT_ROWS_PER_UPCAST, weight.shape[0]), weight.shape[1])
    for start in range(0, weight.shape[0], WEIGHT_ROWS_PER_UPCAST):
        rows = weight[start : start + WEIGHT_ROWS_PER_UPCAST]
        upcast = block[: rows.shape[0]].copy_(rows)
        out[..., start : start + rows.shape[0]] = F.linear(x, upcast)
    return out


def rms_norm(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """x: [..., D] fp32; gamma: [D]. Returns x / sqrt(mean(x^2) + eps) * gamma, fp32."""
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * gamma.to(COMPUTE_DTYPE)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """x: [..., D] fp32; weight, bias: [D]. Returns (x - mean) / sqrt(biased var + eps) * weight + bias, fp32."""
    return F.layer_norm(x, (x.shape[-1],), weight.to(COMPUTE_DTYPE), bias.to(COMPUTE_DTYPE), eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> Tensor:
    """Rotate x: [T, ..., d] fp32 with cos, sin: [T, d/2] fp32 (broadcast over the middle dims).

    interleaved: pairs (x[2i], x[2i+1]); else half-split (NeoX) pairs (x[i], x[i + d/2]). Each pair (a, b) becomes
    (a cos - b sin, a sin + b cos). Returns a new fp32 tensor of x's shape.
    """
    half = x.shape[-1] // 2
    table_shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.reshape(table_shape), sin.reshape(table_shape)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    rotated_a, rotated_b = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        return torch.stack((rotated_a, rotated_b), dim=-1).flatten(-2)
    return torch.cat((rotated_a, rotated_b), dim=-1)


def rope_leading(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> Tensor:
    """RoPE on the FIRST rope = 2 * cos.shape[1] dims of x [T, ..., d] (the indexer's layout); the rest passes."""
    rope_dim = 2 * cos.shape[1]
    return torch.cat((rope(x[..., :rope_dim], cos, sin, interleaved=interleaved), x[..., rope_dim:]), dim=-1)


# fp32 elements one tile of a tiled op may hold at once (32 MiB): small enough for a CPU cache hierarchy to stay
# useful and for many tiles to fit beside a model on a device, large enough that the per-tile GEMMs stay efficient.
TILE_BUDGET_ELEMENTS = 1 << 23


def rows_per_tile(elements_per_row: int, budget: int = TILE_BUDGET_ELEMENTS) -> int:
    """How many rows (tokens) of `elements_per_row` fp32 working elements each fit in one tile (at least one)."""
    return max(1, budget // max(1, elements_per_row))
