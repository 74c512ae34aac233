"""Symmetric weight quantizers: int8 per output channel (W8A8) and int4 per channel or per group (W4A8).

    scale[n, g] = clip[n, g] * max|W[n, group g]| / qmax          qmax = 127 (int8) or 7 (int4)
    codes       = clamp(round_half_even(W / scale), qmin, qmax)   qmin = -127 (int8, as dynamic_quant) or -8 (int4)
    W ~ codes * scale

The clip ratio is 1 (round to nearest, RTN) or, with `mse_clip`, the ratio on a linear grid 1, 0.99, ..., 0.2
that minimises sum |W - deq(W)|^2.4 per channel/group (QuaRot's / GPTQ's `mse=True` search, norm 2.4, grid 100,
max shrink 0.8). int4 codes are packed two per byte along K with ops_reference.pack_int4 (OPS.md section 5:
even k in the low nibble), the layout `glm5_hal.w4a8_matmul` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import ops_reference as ref

# The MSE clip search of QuaRot / GPTQ (`--w_clip`): grid of 100 ratios, shrinking down to 1 - 0.8, |err|^2.4.
CLIP_GRID = 100
CLIP_MAX_SHRINK = 0.8
CLIP_NORM = 2.4


@dataclass(frozen=True)
class WeightQuantSpec:
    """How to quantize a weight [N, K].

    bits: 8 (int8, W8A8 through quant_matmul) or 4 (int4, W4A8 through w4a8_matmul).
    group_size: None = one scale per output channel; else K-elements per scale (int4 only: quant_matmul takes
        per-channel scales only). Must be even and divide K.
    mse_clip: search the clip ratio per channel/group instead of using max|w|.
    """

    bits: int = 8
    group_size: int | None = None
    mse_clip: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits: expected 4 or 8, got {self.bits!r}")
        if self.group_size is not None:
            if self.bits != 4:
                raise ValueError(
                    "group_size: per-group scales are supported for int4 only (quant_matmul is per-channel)"
                )
            if not isinstance(self.group_size, int) or self.group_size <= 0 or self.group_size % 2:
                raise ValueError(f"group_size: expected None or a positive even int, got {self.group_size!r}")

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else 7

    @property
    def qmin(self) -> int:
        return -127 if self.bits == 8 else -8

    def groups(self, k: int) -> int:
        """Number of scale groups along K for a weight with K input features."""
        if self.group_size is None:
            return 1
        if k % self.group_size:
            raise ValueError(f"group_size: expected a divisor of K = {k}, got {self.group_size}")
        return k // self.group_size


@dataclass
class QuantizedWeight:
    """A quantized weight [N, K].

    codes: [N, K], int8. Integer values in [qmin, qmax] (unpacked, also for int4).
    scale: [N, G], float32. G = 1 (per channel) or K / group_size.
    spec: the WeightQuantSpec it was made with.
    """

    codes: Tensor
    scale: Tensor
    spec: WeightQuantSpec

    def dequantize(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """W ~ codes * scale, [N, K] in dtype (the fake-quant weight)."""
        return dequantize(self.codes, self.scale, dtype)

    def packed_int4(self) -> Tensor:
        """[N, K/2], uint8: the int4 codes packed for w4a8_matmul (even k in the low nibble)."""
        if self.spec.bits != 4:
            raise ValueError(f"packed_int4: the weight is int{self.spec.bits}, not int4")
        return torch.from_numpy(ref.pack_int4(self.codes.numpy()))

    def matmul_scale(self) -> Tensor:
        """The weight scale in the shape the HAL GEMMs take: [N] per channel, [N, K/g] per group; float32."""
        return self.scale[:, 0].contiguous() if self.spec.group_size is None else self.scale.contiguous()


def dequantize(codes: Tensor, scale: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """codes [N, K] int, scale [N, G] -> [N, K] in dtype: codes times the scale of each element's group."""
    n, k = codes.shape
    groups = scale.shape[1]
    grouped = codes.to(torch.float64).reshape(n, groups, k // groups) * scale.to(torch.float64)[..., None]
    return grouped.reshape(n, k).to(dtype)


def _grouped(w: Tensor, spec: WeightQuantSpec) -> Tensor:
    """w [N, K] -> [N, G, K/G] float64."""
    n, k = w.shape
    groups = spec.groups(k)
    return w.to(torch.float64).reshape(n, groups, k // groups)


def _round_codes(w: Tensor, scale: Tensor, spec: WeightQuantSpec) -> Tensor:
    """Codes of w [..., m] for scale [...] (broadcast on the last dim), float64 integer values."""
    return torch.clamp(torch.round(w / scale[..., None]), spec.qmin, spec.qmax)


def absmax_scale(amax: Tensor, spec: WeightQuantSpec) -> Tensor:
    """max|w| -> scale = amax / qmax (1 for an all-zero channel/group, so that its codes are 0), float64."""
    amax = amax.to(torch.float64)
    return torch.where(amax > 0, amax / spec.qmax, torch.ones_like(amax))


def find_scale(w: Tensor, spec: WeightQuantSpec) -> Tensor:
    """Scales [N, G] float64 for w [N, K]: absmax, or the MSE-best clip ratio of CLIP_GRID candidates."""
    grouped = _grouped(w, spec)  # [N, G, K/G]
    amax = grouped.abs().amax(dim=-1)  # [N, G]
    best_scale = absmax_scale(amax, spec)
    if not spec.mse_clip:
        return best_scale
    best_err = torch.full_like(amax, float("inf"))
    for i in range(int(CLIP_MAX_SHRINK * CLIP_GRID) + 1):
        scale = absmax_scale(amax * (1 - i / CLIP_GRID), spec)
        err = ((_round_codes(grouped, scale, spec) * scale[..., None] - grouped).abs() ** CLIP_NORM).sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    return best_scale


def quantize_with_scale(w: Tensor, scale: Tensor, spec: WeightQuantSpec) -> Tensor:
    """Codes [N, K] int8 of w [N, K] for given scales [N, G]."""
    grouped = _grouped(w, spec)
    return _round_codes(grouped, scale.to(torch.float64), spec).reshape(w.shape).to(torch.int8)


def rtn_quantize(w: Tensor, spec: WeightQuantSpec) -> QuantizedWeight:
    """Round-to-nearest quantization of w [N, K] (any float dtype), with the spec's clip choice."""
    if w.dim() != 2:
        raise ValueError(f"w: expected a weight [N, K], got shape {tuple(w.shape)}")
    if spec.bits == 4 and w.shape[1] % 2:
        raise ValueError(f"w: int4 weights pack two per byte along K, expected an even K, got K = {w.shape[1]}")
    # The codes are rounded against the float32 scale that is stored, so dequantize() is exactly what was chosen.
    scale = find_scale(w, spec).to(torch.float32)
    return QuantizedWeight(quantize_with_scale(w, scale, spec), scale, spec)
