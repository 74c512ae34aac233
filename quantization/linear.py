"""QuantLinear: a W8A8 or W4A8 linear layer that runs through the public HAL ops, so on any backend.

x [..., K] -> dynamic_quant (int8 per token) -> quant_matmul (int8 weights)      W8A8
                                             -> w4a8_matmul (packed int4 weights) W4A8
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm5_hal.quant_layers import int_linear
from quantization.quantizers import QuantizedWeight, WeightQuantSpec, rtn_quantize

# Scheme names, as written in a quantized checkpoint's JSON description.
W8A8 = "w8a8"
W4A8 = "w4a8"
_W8 = WeightQuantSpec(bits=8)


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W quantized (int8 or int4, per channel or per group) and x quantized per token.

    Buffers:
        weight: [N, K] int8 (W8A8) or [N, K/2] uint8 (W4A8, int4 packed two per byte along K, even k low nibble).
        weight_scale: [N] fp32 per channel, or [N, K/group_size] fp32 (W4A8 with groups).
        bias: [N] fp32 or None.
    """

    def __init__(
        self, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, scheme: str, group_size: int | None = None
    ) -> None:
        super().__init__()
        if scheme not in (W8A8, W4A8):
            raise ValueError(f"scheme: expected {W8A8!r} or {W4A8!r}, got {scheme!r}")
        expected_dtype = torch.int8 if scheme == W8A8 else torch.uint8
        if weight.dtype != expected_dtype or weight.dim() != 2:
            raise TypeError(
                f"weight: expected a 2-D {expected_dtype} tensor for {scheme}, got {weight.dtype} {tuple(weight.shape)}"
            )
        self.scheme = scheme
        self.group_size = group_size
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1] * (2 if scheme == W4A8 else 1)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.to(torch.float32))
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32))

    @classmethod
    def from_quantized(cls, qweight: QuantizedWeight, bias: Tensor | None = None) -> QuantLinear:
        """A QuantLinear holding an RTN/GPTQ result (int8 codes -> W8A8, int4 codes -> packed W4A8)."""
        if qweight.spec.bits == 8:
            return cls(qweight.codes, qweight.matmul_scale(), bias, W8A8)
        return cls(qweight.packed_int4(), qweight.matmul_scale(), bias, W4A8, qweight.spec.group_size)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None, spec: WeightQuantSpec = _W8) -> QuantLinear:
        """RTN-quantize a float weight [N, K] (nn.Linear layout)."""
        return cls.from_quantized(rtn_quantize(weight, spec), bias)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., K] bf16/fp16/fp32 -> y [..., N] in x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected a last dim of {self.in_features}, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features)
        y = int_linear(rows, self.weight, self.weight_scale, group_size=self.group_size, bias=self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}{group}"
