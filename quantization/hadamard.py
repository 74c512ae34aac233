"""Random Hadamard rotations Q = diag(s) H / sqrt(n) as torch tensors, for every GLM-5 / DeepSeek-V3.2 size.

    H = kron(H_K, H_P), n = K * P, P = 2^m        (ops_reference.hadamard.hadamard_matrix builds it)
    Q = diag(s) H / sqrt(n), s in {-1, +1}^n     (QuaRot's random_hadamard_matrix; Q^T Q = I)

Sizes the two models need: hidden 6144 = 12 x 512 and 7168 = 28 x 256, dense intermediate 12288 = 12 x 1024
and 18432 = 36 x 512, q_lora 2048 and 1536 = 12 x 128, kv_lora 512, v_head 256 and 128 (all K * 2^m).

A `HadamardRotation` keeps the two small factors (H_K and H_P, never the n x n matrix), so rotating a
[rows, 18432] weight costs rows * n * (K + P) multiply-adds and no 2.7 GB matrix; `matrix()` builds the dense
Q when a test or a small model wants it.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

from ops_reference.hadamard import hadamard_base_size, hadamard_matrix

# Every rotation size of the GLM-5 and DeepSeek-V3.2 presets (hidden, intermediates, latents, head dims).
MODEL_ROTATION_SIZES = (6144, 7168, 12288, 18432, 2048, 1536, 512, 256, 128)


@functools.cache
def _factor_matrices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(H_K [K, K], H_P [P, P]), +-1 float64, with hadamard_matrix(n) = kron(H_K, H_P)."""
    k = hadamard_base_size(n)
    if k is None:
        # hadamard_matrix raises the error that names n and the supported forms.
        hadamard_matrix(n)
    # hadamard_matrix(K) is the base matrix itself (K * 2^0); hadamard_matrix(P) is Sylvester's for a power of 2.
    return hadamard_matrix(k), hadamard_matrix(n // k)


def hadamard(n: int, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """Orthonormal Hadamard matrix [n, n] = kron(H_K, H_P) / sqrt(n) (OPS.md section 5's H, normalised)."""
    h_k, h_p = _factor_matrices(n)
    return torch.from_numpy(np.kron(h_k, h_p) / math.sqrt(n)).to(dtype)


def random_signs(n: int, seed: int) -> Tensor:
    """[n] float64 of +-1, a deterministic function of (n, seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1


class HadamardRotation:
    """Q = diag(signs) H / sqrt(n), applied to the last dim of a tensor without forming Q.

    Args:
        n: the rotated width, K * 2^m (see MODEL_ROTATION_SIZES).
        signs: [n] +-1 (any float dtype), or None for all +1 (the plain normalised Hadamard).

    `rotate(x)` = x @ Q and `unrotate(x)` = x @ Q^T, for x [..., n]; they compute in float64 and return x's
    dtype. Rotating a residual stream by Q: readers W [out, n] become rotate(W) = W Q, writers W [n, in] become
    rotate(W.T).T = Q^T W.
    """

    def __init__(self, n: int, signs: Tensor | None = None) -> None:
        h_k, h_p = _factor_matrices(n)
        self.n = n
        self._h_k = torch.from_numpy(h_k)  # [K, K]
        self._h_p = torch.from_numpy(h_p)  # [P, P]
        if signs is None:
            signs = torch.ones(n, dtype=torch.float64)
        if signs.shape != (n,) or not bool(torch.all(signs.abs() == 1)):
            raise ValueError(f"signs: expected [{n}] of +-1, got shape {tuple(signs.shape)}")
        self.signs = signs.to(torch.float64)

    @classmethod
    def random(cls, n: int, seed: int) -> HadamardRotation:
        """The random-sign Hadamard rotation of size n for a seed (QuaRot's random_hadamard_matrix)."""
        return cls(n, random_signs(n, seed))

    def _times_h(self, x: Tensor, transpose: bool) -> Tensor:
        """x [..., n] @ H (or @ H^T) / sqrt(n), via x viewed [..., K, P]: y[i, l] = sum_jm x[j, m] A[j, i] B[m, l]."""
        k, p = self._h_k.shape[0], self._h_p.shape[0]
        blocks = x.reshape(*x.shape[:-1], k, p)
        h_k = self._h_k.T if transpose else self._h_k
        h_p = self._h_p.T if transpose else self._h_p
        y = torch.einsum("...jm,ji,ml->...il", blocks, h_k, h_p)
        return y.reshape(x.shape) / math.sqrt(self.n)

    def _check_width(self, x: Tensor) -> None:
        if x.shape[-1] != self.n:
            raise ValueError(f"x: expected a last dim of {self.n} (the rotation size), got shape {tuple(x.shape)}")

    def rotate(self, x: Tensor) -> Tensor:
        """x [..., n] -> x @ Q [..., n], x's dtype (computed in float64)."""
        self._check_width(x)
        return self._times_h(x.to(torch.float64) * self.signs, transpose=False).to(x.dtype)

    def unrotate(self, x: Tensor) -> Tensor:
        """x [..., n] -> x @ Q^T [..., n], x's dtype (computed in float64); unrotate(rotate(x)) == x."""
        self._check_width(x)
        return (self._times_h(x.to(torch.float64), transpose=True) * self.signs).to(x.dtype)

    def matrix(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The dense Q [n, n] (n^2 elements: meant for small n and for tests)."""
        return self.rotate(torch.eye(self.n, dtype=torch.float64)).to(dtype)


def orthogonality_error(q: Tensor) -> float:
    """max |Q^T Q - I| of a square matrix q [n, n] (computed in float64)."""
    if q.dim() != 2 or q.shape[0] != q.shape[1]:
        raise ValueError(f"q: expected a square [n, n] matrix, got shape {tuple(q.shape)}")
    q64 = q.to(torch.float64)
    return float((q64.T @ q64 - torch.eye(q.shape[0], dtype=torch.float64)).abs().max())


def rotation_orthogonality_error(rotation: HadamardRotation, probes: int = 8, seed: int = 0) -> float:
    """Orthogonality of a rotation without forming it: max relative error of |xQ| = |x| and (xQ)Q^T = x over
    `probes` random vectors (cheap for n = 18432, where Q^T Q would take 6e12 flops)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(probes, rotation.n, generator=gen, dtype=torch.float64)
    y = rotation.rotate(x)
    norm_err = ((y.norm(dim=-1) - x.norm(dim=-1)).abs() / x.norm(dim=-1)).max()
    back_err = ((rotation.unrotate(y) - x).norm(dim=-1) / x.norm(dim=-1)).max()
    return float(max(norm_err, back_err))
