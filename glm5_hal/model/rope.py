"""RoPE tables from token positions (with DeepSeek-V3.2's YaRN), and RoPE itself for the decomposed prologs.

The ops take `cos, sin` fp32 [T, rope/2] at each token's position (OPS.md "Conventions"); this module makes
them once per forward call, shared by every layer, by MLA and by the indexer.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from glm5_hal.checks import accumulation_dtype
from glm5_hal.config import ModelConfig, YarnScaling


def _yarn_correction_dim(num_rotations: float, dim: int, theta: float, max_positions: int) -> float:
    """The RoPE dimension whose wavelength completes `num_rotations` turns over `max_positions` tokens."""
    return dim * math.log(max_positions / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """inv_freq [rope/2] fp64: theta^(-2i/rope), blended with theta^(-2i/rope) / factor under YaRN.

    YaRN (DeepSeek-V3 / V3.2): dimensions that turn more than beta_fast times over the original context keep
    their frequency, those that turn fewer than beta_slow times are interpolated (divided by `factor`), and a
    linear ramp mixes the two in between. The softmax correction (mscale^2) lives in cfg.sm_scale; with
    mscale == mscale_all_dim the cos/sin tables themselves are not rescaled.
    """
    return _cached_inv_freq(cfg).clone()


def _cached_inv_freq(cfg: ModelConfig) -> Tensor:
    return _inv_freq(cfg.qk_rope_head_dim, float(cfg.rope_theta), cfg.rope_scaling)


@functools.lru_cache(maxsize=16)
def _inv_freq(dim: int, theta: float, yarn: YarnScaling | None) -> Tensor:
    """rope_inv_freq's table, made once per (dim, theta, scaling): rope_cos_sin runs at every decode step, and the
    table's dozen small torch ops were ~1% of a vLLM decode step (the plugin, glm5-mini dims). Read only."""
    extrapolated = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if yarn is None or yarn.factor <= 1.0:
        return extrapolated
    if yarn.mscale != yarn.mscale_all_dim:
        raise NotImplementedError(
            f"rope_scaling: mscale ({yarn.mscale}) != mscale_all_dim ({yarn.mscale_all_dim}) would scale cos/sin; "
            "not supported"
        )
    max_pos = yarn.original_max_position_embeddings
    low = max(math.floor(_yarn_correction_dim(yarn.beta_fast, dim, theta, max_pos)), 0)
    high = min(math.ceil(_yarn_correction_dim(yarn.beta_slow, dim, theta, max_pos)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    keep = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate
    return extrapolated / yarn.factor * (1.0 - keep) + extrapolated * keep


def rope_cos_sin(cfg: ModelConfig, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos, sin: [T, rope/2] at `positions` (int [T]) in `dtype` (fp32, the ops' contract; fp64 for a float64
    model); angles computed in fp64 for long contexts."""
    inv_freq = _cached_inv_freq(cfg).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> Tensor:
    """RoPE of x [T, ..., rope] with cos, sin [T, rope/2] (OPS.md pair layouts), computed in fp32 (fp64 for
    fp64 x), x's dtype out."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    xf = x.to(accumulation_dtype(x.dtype))
    half = x.shape[-1] // 2
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :half], xf[..., half:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = torch.stack([ra, rb], -1).flatten(-2) if interleaved else torch.cat([ra, rb], -1)
    return out.to(x.dtype)
