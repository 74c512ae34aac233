"""The Hadamard constructions of ops_reference.hadamard: every base matrix is Hadamard, the Kronecker order is
QuaRot's (K on the slow index), and the transform is orthonormal at the sizes GLM-5 and DeepSeek-V3.2 use."""

from __future__ import annotations

import numpy as np
import pytest

import ops_reference as ref
from glm5_hal.ops.quant import HADAMARD_BASE_SIZES
from ops_reference.hadamard import _base_matrix

RNG = np.random.default_rng()


@pytest.mark.parametrize("k", ref.HADAMARD_BASE_SIZES)
def test_every_base_matrix_is_hadamard(k):
    h = _base_matrix(k)
    assert h.shape == (k, k) and set(np.unique(h)) <= {-1.0, 1.0}
    np.testing.assert_array_equal(h @ h.T, k * np.eye(k))


def test_base_sizes_agree_with_the_public_op():
    assert tuple(ref.HADAMARD_BASE_SIZES) == tuple(HADAMARD_BASE_SIZES)


@pytest.mark.parametrize(
    ("n", "k"), [(6144, 12), (7168, 28), (12288, 12), (18432, 36), (1536, 12), (2048, 1), (160, 40), (344, 172)]
)
def test_base_size_selection(n, k):
    assert ref.hadamard_base_size(n) == k


@pytest.mark.parametrize("n", [7, 44, 0, 100])
def test_unsupported_sizes_name_n(n):
    assert ref.hadamard_base_size(n) is None
    with pytest.raises(ValueError, match=f"n: expected .* got {n}"):
        ref.hadamard_matrix(n)


def test_kronecker_order_puts_k_on_the_slow_index():
    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=np.float64)
    np.testing.assert_array_equal(ref.hadamard_matrix(48), np.kron(_base_matrix(12), h4))


@pytest.mark.parametrize("n", [96, 112, 344, 312, 160, 208])
def test_transform_equals_the_matrix_product(n):
    x = RNG.normal(size=(3, n))
    np.testing.assert_allclose(ref.hadamard_transform(x), x @ ref.hadamard_matrix(n).T / np.sqrt(n), atol=1e-12)
    np.testing.assert_allclose(ref.hadamard_transform(x, scale=1.0), x @ ref.hadamard_matrix(n).T, atol=1e-10)


@pytest.mark.parametrize("n", [6144, 7168])
def test_transform_is_orthonormal_at_model_sizes(n):
    x = RNG.normal(size=(4, n))
    y = ref.hadamard_transform(x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-12)
    np.testing.assert_allclose(y @ y.T, x @ x.T, rtol=1e-10, atol=1e-9)  # inner products preserved
