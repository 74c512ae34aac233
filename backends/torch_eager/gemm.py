"""The float GEMMs of one op call, in the precision glm5_hal.capabilities chose for the call's device and
activation dtype.

    gemm = gemm_for(x.dtype, x.device)
    y = gemm.linear(h, weight)      # [..., in] @ [out, in]^T -> [..., out] fp32
    s = gemm.bmm(a, b)              # [B, M, K] @ [B, K, N] -> [B, M, N] fp32

Two paths, one interface:
- FP32 (fp32 activations always; bf16 / fp16 where the probe found no faster unit, or GLM5_HAL_FAST_PATHS=0): the
  operands are upcast to fp32, exactly the code the backend ran before it had fast paths.
- half-precision operands (bf16 / fp16 activations where the probe says so): the operands are given in the
  activation dtype and the GEMM accumulates in fp32. The result comes back in fp32 where the device's GEMM can
  return it (out_dtype); elsewhere (CPUs: bf16 only) the GEMM's bf16 result, rounded once from its fp32
  accumulator, is upcast. Everything around the GEMMs (norms, RoPE, softmax statistics, lse) stays fp32, and
  an intermediate feeding the next GEMM is rounded to the activation dtype as a bf16 model's own layers would.

Products that feed a softmax (attention logits) take `gemm.logits`: a rounded result is not acceptable there, since
exp() turns the rounding error of a logit (2^-9 of its magnitude, which is 0.06 at a logit of 30) into a relative
error of the probability. So they use half-precision operands only where the GEMM returns fp32, and fp32 elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from backends.torch_eager.primitives import COMPUTE_DTYPE, linear
from glm5_hal.capabilities import capabilities


@dataclass(frozen=True)
class Gemm:
    """operand: the dtype GEMM operands are given in (COMPUTE_DTYPE = the fp32 path). fp32_output: the GEMM returns
    its fp32 accumulators (torch.mm / torch.bmm with out_dtype=float32) rather than an `operand` result."""

    operand: torch.dtype
    fp32_output: bool = True

    @property
    def half(self) -> bool:
        return self.operand != COMPUTE_DTYPE

    @property
    def logits(self) -> Gemm:
        """The path for products that feed a softmax: this one if it returns fp32 results, else FP32 (see the
        module docstring)."""
        return self if self.fp32_output else FP32

    def bmm(self, a: Tensor, b: Tensor) -> Tensor:
        """a [B, M, K] @ b [B, K, N] -> [B, M, N] fp32 (any float dtypes in, converted to `operand`)."""
        a, b = a.to(self.operand), b.to(self.operand)
        if not self.half:
            return torch.bmm(a, b)
        if self.fp32_output:
            return torch.bmm(a, b, out_dtype=COMPUTE_DTYPE)
        return torch.bmm(a, b).to(COMPUTE_DTYPE)

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """x [..., in] (any float dtype) @ weight [out, in]^T -> [..., out] fp32.

        A weight in another dtype than `operand` (an fp32 weight beside bf16 activations) takes the fp32 path:
        rounding a weight on every call would cost a full copy and lose its precision.
        """
        if not self.half or weight.dtype != self.operand:
            return linear(x.to(COMPUTE_DTYPE), weight)
        x = x.to(self.operand)
        if self.fp32_output:
            flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.T, out_dtype=COMPUTE_DTYPE)
            return flat.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight).to(COMPUTE_DTYPE)


FP32 = Gemm(COMPUTE_DTYPE)


def gemm_for(activation: torch.dtype, device: torch.device) -> Gemm:
    """The GEMM path of an op whose activations are `activation` on `device` (fp32 unless the probe chose the
    half-precision path for bf16 / fp16 there)."""
    choice = capabilities(device).half_choice(activation)
    if choice is None or not choice.use:
        return FP32
    return Gemm(activation, choice.fp32_output)
