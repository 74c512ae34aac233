"""Hadamard transform over the last dim n = K * 2^m: fast Walsh-Hadamard butterflies over the 2^m factor (m stages,
O(n log n)), then one small [K, K] GEMM with the base matrix H_K (K on the slow index), in fp32."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from backends.torch_eager.primitives import COMPUTE_DTYPE
from glm5_hal.ops.quant import hadamard_base_size


@functools.lru_cache(maxsize=64)
def base_matrix(base: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """H_K [K, K] of +-1 entries, read once per (K, device, dtype) from the reference's construction (QuaRot's
    matrices are tables, not formulas, so they are defined in one place)."""
    from ops_reference.hadamard import hadamard_matrix  # numpy only; imported when a K > 1 size is first used

    return torch.as_tensor(hadamard_matrix(base), dtype=dtype, device=device)


def walsh_hadamard(x: Tensor) -> Tensor:
    """x: [..., 2^m] -> x @ H_{2^m} (Sylvester order, unnormalised), by m butterfly stages; same dtype as x."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    half_span = 1
    while half_span < n:
        # Pair each element with the one half_span away inside blocks of 2 * half_span: (a, b) -> (a + b, a - b).
        pairs = x.reshape(*lead, n // (2 * half_span), 2, half_span)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2)
        half_span *= 2
    return x.reshape(*lead, n)


def hadamard_transform(x: Tensor, *, scale: float | None = None) -> Tensor:
    """scale * x @ (H_K kron H_{2^m})^T over the last dim (validated by glm5_hal.hadamard_transform).

    x: [..., n], n = K * 2^m with the largest supported K. scale: None = 1 / sqrt(n) (orthonormal). Returns
    [..., n] in x's dtype.
    """
    n = x.shape[-1]
    base = hadamard_base_size(n)
    x32 = x.to(COMPUTE_DTYPE)
    if base == 1:
        y = walsh_hadamard(x32)
    else:
        # K on the slow index: view x as [..., K, 2^m]; y = H_K @ X @ H_{2^m}^T, and H_{2^m} is symmetric.
        mixed = walsh_hadamard(x32.reshape(*x.shape[:-1], base, n // base))
        y = torch.matmul(base_matrix(base, x.device, COMPUTE_DTYPE), mixed).reshape(x.shape)
    # Contiguous as the op's fake (and every other backend) returns it: the butterflies' elementwise ops keep a
    # permuted input's strides (a column-major [..., 2, 2] x came back column-major), which torch.compile's traced
    # strides would then contradict.
    return (y * (n**-0.5 if scale is None else scale)).to(x.dtype).contiguous()
