"""RMSNorm and LayerNorm over the last dim, in float64."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * gamma. x: [..., D]; gamma: [D]."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * weight + bias, biased variance. x: [..., D]; weight, bias: [D]."""
    x = np.asarray(x, np.float64)
    centered = x - x.mean(axis=-1, keepdims=True)
    return centered / np.sqrt(np.mean(centered * centered, axis=-1, keepdims=True) + eps) * weight + bias
