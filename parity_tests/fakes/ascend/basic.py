"""Fake torch_npu kernels for the small building blocks: format cast, RMSNorm, RoPE, scatter update, SwiGLU.

Each kernel's docstring quotes the torch_npu 2.14.0 rules it enforces (torch_npu/_op_plugin_docs.py and the
op-plugin docs); the numbers come from ops_reference or from the documented formula in float64.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.ascend.common import (
    FLOAT_DTYPES,
    HALF_DTYPES,
    device_tensor,
    host,
    mark,
    not_modeled,
    require,
)

ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29


def npu_format_cast(self: Tensor, acl_format: int, *, customize_dtype=None, input_dtype=None) -> Tensor:
    """ND <-> FRACTAL_NZ. The values are unchanged; the fake remembers the format so consumers that require
    FRACTAL_NZ weights (npu_mla_prolog_v3) can check it."""
    op = "npu_format_cast"
    not_modeled(acl_format in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ), op, f"acl_format {acl_format}")
    not_modeled(customize_dtype is None and input_dtype is None, op, "customize_dtype / input_dtype")
    require(self.dim() >= 2, op, "FRACTAL_NZ is a 2-D blocked layout: the tensor must have 2 or more dims")
    return mark(self.clone(), "format", acl_format)


def npu_rms_norm(self: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """self: fp16/bf16/fp32, 2-8 dims; gamma: self's dtype, the trailing dims of self.
    Returns (y in self's dtype, rstd fp32 with gamma's dims reduced to 1)."""
    op = "npu_rms_norm"
    require(self.dtype in FLOAT_DTYPES, op, f"self must be float16/bfloat16/float32, got {self.dtype}")
    require(2 <= self.dim() <= 8, op, f"self must have 2-8 dims, got {self.dim()}")
    require(gamma.dtype == self.dtype, op, f"gamma must have self's dtype {self.dtype}, got {gamma.dtype}")
    require(
        tuple(gamma.shape) == tuple(self.shape[self.dim() - gamma.dim() :]),
        op,
        f"gamma {tuple(gamma.shape)} must be the trailing dims of self {tuple(self.shape)}",
    )
    x = host(self)
    axes = tuple(range(x.ndim - gamma.dim(), x.ndim))
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + epsilon)
    y = x * rstd * host(gamma)
    return device_tensor(y, self.dtype, self), device_tensor(rstd, torch.float32, self)


def interleave_rope_formula(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The InterleaveRope formula of the CANN docs: q = reshape(x, [..., D/2, 2]).transpose(-1, -2).reshape(x.shape);
    out = q * cos + RotateHalf(q) * sin, RotateHalf(q) = cat(-q[..., D/2:], q[..., :D/2]).
    The rotated pairs come out as halves, not interleaved."""
    half = x.shape[-1] // 2
    q = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    rotated = np.concatenate([-q[..., half:], q[..., :half]], axis=-1)
    return q * cos + rotated * sin


def npu_interleave_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, N, S, D) bf16/fp16, contiguous, D = 64. cos, sin: (B, 1, S or 1, D), x's dtype, contiguous."""
    op = "npu_interleave_rope"
    require(x.dim() == 4 and x.shape[-1] == 64, op, f"x must be (B, N, S, 64), got {tuple(x.shape)}")
    require(x.dtype in HALF_DTYPES, op, f"x must be bfloat16/float16, got {x.dtype}")
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        require(t.is_contiguous(), op, f"{name} must be contiguous")
    for name, t in (("cos", cos), ("sin", sin)):
        require(t.dtype == x.dtype, op, f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
        require(
            t.dim() == 4
            and t.shape[0] == x.shape[0]
            and t.shape[1] == 1
            and t.shape[2] in (1, x.shape[2])
            and t.shape[3] == 64,
            op,
            f"{name} must be (B, 1, S or 1, 64) for x {tuple(x.shape)}, got {tuple(t.shape)}",
        )
    return device_tensor(interleave_rope_formula(host(x), host(cos), host(sin)), x.dtype, x)


def rotary_mul_formula(x: np.ndarray, r1: np.ndarray, r2: np.ndarray, mode: str) -> np.ndarray:
    """npu_rotary_mul's documented formula. half: x_new = cat(-x2, x1) of the two halves; interleave: x_new holds
    (-x[2i+1], x[2i]) at (2i, 2i+1). out = r1 * x + r2 * x_new."""
    if mode == "half":
        x1, x2 = np.split(x, 2, axis=-1)
        x_new = np.concatenate([-x2, x1], axis=-1)
    else:
        x_new = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    return r1 * x + r2 * x_new


def npu_rotary_mul(self: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half", rotate=None) -> Tensor:
    """self: 4-D fp16/bf16/fp32, D even and < 896. r1 (cos), r2 (sin): 4-D, self's dtype, values in [-1, 1],
    broadcastable to self; in "interleave" mode only the 1S1D-style layouts (one non-1 leading dim) and the other
    two leading dims of self multiply to < 1000. half: out = r1*x + r2*cat(-x2, x1); interleave: out = r1*x +
    r2*interleave(-x_odd, x_even)."""
    op = "npu_rotary_mul"
    require(
        rotary_mode in ("half", "interleave"), op, f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}"
    )
    not_modeled(rotate is None, op, "the rotate matrix")
    require(self.dim() == 4, op, f"input must be 4-D, got {tuple(self.shape)}")
    require(self.dtype in FLOAT_DTYPES, op, f"input must be float16/bfloat16/float32, got {self.dtype}")
    width = self.shape[-1]
    require(width % 2 == 0 and width < 896, op, f"D must be even and < 896, got {width}")
    for name, t in (("r1", r1), ("r2", r2)):
        require(t.dtype == self.dtype, op, f"{name} must have the input's dtype {self.dtype}, got {t.dtype}")
        require(t.dim() == 4 and t.shape[-1] == width, op, f"{name} must be 4-D with D = {width}, got {tuple(t.shape)}")
        require(
            all(a in (1, b) for a, b in zip(t.shape, self.shape)),
            op,
            f"{name} {tuple(t.shape)} must broadcast to {tuple(self.shape)}",
        )
        require(bool((t.abs() <= 1.0 + 1e-3).all()), op, f"{name} values must lie in [-1, 1]")
    if rotary_mode == "interleave":
        varying = [i for i in range(3) if r1.shape[i] != 1]
        require(len(varying) <= 1, op, f"interleave mode takes r1 layouts 11SD/1S1D/S11D, got {tuple(r1.shape)}")
        others = [self.shape[i] for i in range(3) if i not in varying[:1]]
        require(int(np.prod(others[-2:])) < 1000, op, "interleave mode needs B * N < 1000")
    return device_tensor(rotary_mul_formula(host(self), host(r1), host(r2), rotary_mode), self.dtype, self)


SCATTER_DTYPES = (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8)


def npu_scatter_nd_update_(self: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """self: 1-8 dims of a documented dtype; indices: int32/int64, >= 2-D, last dim a <= self.dim(), in bounds;
    updates: self's dtype, shape indices.shape[:-1] + self.shape[a:]. Repeated indices are undefined, so refused."""
    op = "npu_scatter_nd_update_"
    require(self.dtype in SCATTER_DTYPES, op, f"input dtype {self.dtype} is not supported")
    require(1 <= self.dim() <= 8, op, f"input must have 1-8 dims, got {self.dim()}")
    require(indices.dtype in (torch.int32, torch.int64), op, f"indices must be int32/int64, got {indices.dtype}")
    require(indices.dim() >= 2 and indices.shape[-1] <= self.dim(), op, f"bad indices shape {tuple(indices.shape)}")
    depth = indices.shape[-1]
    want = tuple(indices.shape[:-1]) + tuple(self.shape[depth:])
    require(tuple(updates.shape) == want, op, f"updates must have shape {want}, got {tuple(updates.shape)}")
    require(updates.dtype == self.dtype, op, f"updates must have input's dtype {self.dtype}, got {updates.dtype}")
    flat = indices.reshape(-1, depth).to(torch.int64)
    bounds = torch.tensor(self.shape[:depth], device=flat.device)
    require(bool(((flat >= 0) & (flat < bounds)).all()), op, "indices out of bounds")
    require(torch.unique(flat, dim=0).shape[0] == flat.shape[0], op, "repeated indices give an undefined result")
    self[tuple(flat.t())] = updates.reshape(-1, *self.shape[depth:])
    return self


def npu_swiglu(self: Tensor, dim: int = -1) -> Tensor:
    """self: fp32/fp16/bf16, 1-8 dims, even along `dim`. out = swish(A) * B, A and B the two halves along dim."""
    op = "npu_swiglu"
    require(self.dtype in FLOAT_DTYPES, op, f"input must be float32/float16/bfloat16, got {self.dtype}")
    require(self.shape[dim] % 2 == 0, op, f"dim {dim} must have an even size, got {self.shape[dim]}")
    gate, up = np.split(host(self), 2, axis=dim)
    return device_tensor(ref.silu(gate) * up, self.dtype, self)
