"""Quantization ops (OPS.md section 5): per-token int8, W8A8 and W4A8 GEMMs, int4 packing."""

from __future__ import annotations

import numpy as np


def dynamic_quant(x):
    """-> (q int8 [...,K], scale [...]): symmetric per token, scale = max|x| / 127 (1 for a zero row),
    q = clamp(round_half_even(x / scale), -127, 127). A row holding NaN or +-inf gets scale max|x| / 127 (NaN,
    or inf) and codes 0: int8 has no NaN, and the non-finite scale carries it into everything computed from the
    row (docs/ops.md "NaN")."""
    x = np.asarray(x, np.float64)
    amax = np.abs(x).max(axis=-1)  # NaN if the row holds one
    scale = np.where(amax == 0, 1.0, amax / 127.0)
    finite = np.isfinite(scale)
    with np.errstate(invalid="ignore"):
        codes = np.clip(np.rint(x / scale[..., None]), -127, 127)
    return np.where(finite[..., None], codes, 0).astype(np.int8), scale


def int_matmul(a_q: np.ndarray, b_q: np.ndarray) -> np.ndarray:
    """Exact integer a_q [M,K] @ b_q[N,K]^T (int64 accumulation; every int32 accumulator fits)."""
    return np.asarray(a_q, np.int64) @ np.asarray(b_q, np.int64).T


def quant_matmul(x_q, x_scale, w_q, w_scale, bias=None):
    """-> y [M,N] = int32(x_q @ w_q^T) * x_scale[:,None] * w_scale[None,:] (+ bias)."""
    y = int_matmul(x_q, w_q) * np.asarray(x_scale, np.float64)[:, None] * np.asarray(w_scale, np.float64)[None, :]
    return y if bias is None else y + np.asarray(bias, np.float64)


def pack_int4(w_q: np.ndarray) -> np.ndarray:
    """int4 values [N,K] in [-8,7] -> uint8 [N,K/2], two per byte along K: even k low nibble, odd k high."""
    w_q = np.asarray(w_q, np.int64)
    if w_q.shape[-1] % 2 or w_q.min(initial=0) < -8 or w_q.max(initial=0) > 7:
        raise ValueError(f"w_q: expected int4 values in [-8, 7] with an even K, got shape {w_q.shape}")
    nibbles = w_q & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(w_packed: np.ndarray) -> np.ndarray:
    """uint8 [N,K/2] -> int8 [N,K] in [-8,7] (inverse of pack_int4)."""
    b = np.asarray(w_packed, np.int64)
    nibbles = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)


def w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size=None):
    """-> y [M,N]: per group of group_size along K (None: one group = per channel), the int32 accumulation of
    x_q @ w^T times the group's weight scale (w_scale [N] or [N, K/g]), summed, times x_scale."""
    w_q = unpack_int4(w_packed)
    k = w_q.shape[1]
    group = k if group_size is None else group_size
    w_scale = np.asarray(w_scale, np.float64).reshape(w_q.shape[0], k // group)  # [N, K/g]
    y = np.zeros((np.asarray(x_q).shape[0], w_q.shape[0]))
    for g in range(k // group):
        cols = slice(g * group, (g + 1) * group)
        y += int_matmul(np.asarray(x_q)[:, cols], w_q[:, cols]) * w_scale[None, :, g]
    return y * np.asarray(x_scale, np.float64)[:, None]


def quantize_weight_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8: -> (w_q int8 [N,K], w_scale [N]) with w ~ w_q * w_scale[:,None]."""
    return dynamic_quant(w)


def quantize_weight_int4(w: np.ndarray, group_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 per output channel (or per group of group_size along K): -> (w_packed uint8 [N,K/2],
    w_scale [N] or [N, K/g]), scale = max|w| / 7 over the group (1 for zeros), codes clamped to [-8, 7]."""
    w = np.asarray(w, np.float64)
    n, k = w.shape
    group = k if group_size is None else group_size
    grouped = w.reshape(n, k // group, group)
    amax = np.abs(grouped).max(axis=-1)
    scale = np.where(amax > 0, amax / 7.0, 1.0)
    codes = np.clip(np.rint(grouped / scale[..., None]), -8, 7).reshape(n, k)
    return pack_int4(codes), (scale[:, 0] if group_size is None else scale)
