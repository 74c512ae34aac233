"""Rotary position embedding in the two pair layouts of OPS.md.

Interleaved pairs are (x[2i], x[2i+1]); half-split (NeoX) pairs are (x[i], x[i + d/2]). Each pair (a, b) is
rotated by its angle: (a cos - b sin, a sin + b cos).
"""

from __future__ import annotations

import numpy as np


def rope_cos_sin(positions: np.ndarray, rope_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [T, rope_dim/2] of angle_i(pos) = pos * theta^(-2i/rope_dim), for positions [T]."""
    inv_freq = float(theta) ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, interleaved: bool) -> np.ndarray:
    """Rotate x: [T, ..., d] with cos, sin: [T, d/2] (broadcast over the middle dims)."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    cos = np.asarray(cos, np.float64).reshape(cos.shape[0], *([1] * (x.ndim - 2)), half)
    sin = np.asarray(sin, np.float64).reshape(sin.shape[0], *([1] * (x.ndim - 2)), half)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :half], out[..., half:] = ra, rb
    return out
