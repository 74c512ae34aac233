"""Error metrics of a quantized result against a float64 reference: SQNR in dB and cosine similarity."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _pair(reference: Tensor, test: Tensor) -> tuple[Tensor, Tensor]:
    if reference.shape != test.shape:
        raise ValueError(f"test: expected the reference's shape {tuple(reference.shape)}, got {tuple(test.shape)}")
    return reference.to(torch.float64).flatten(), test.to(torch.float64).flatten()


def sqnr_db(reference: Tensor, test: Tensor) -> float:
    """Signal-to-quantization-noise ratio 20 log10(|ref| / |ref - test|) in dB, over all elements, in float64.
    inf when test equals the reference."""
    ref, out = _pair(reference, test)
    noise = float((ref - out).norm())
    return math.inf if noise == 0 else 20 * math.log10(float(ref.norm()) / noise)


def cosine(reference: Tensor, test: Tensor) -> float:
    """Cosine similarity of the flattened tensors, in float64."""
    ref, out = _pair(reference, test)
    return float(ref @ out / (ref.norm() * out.norm()))
