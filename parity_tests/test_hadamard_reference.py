"""The Hadamard constructions of ops_reference.hadamard: every base matrix is Hadamard, the Kronecker order is
QuaRot's (K on the slow index), and the transform is orthonormal at the sizes GLM-5 and DeepSeek-V3.2 use."""

from __future__ import annotations

import numpy as np
import pytest

import ops_reference as ref
from glm5_hal.ops.quant import HADAMARD_BASE_SIZES
from ops_reference.hadamard import _WILLIAMSON_ROWS, _base_matrix

RNG = np.random.default_rng()


@pytest.mark.parametrize("k", ref.HADAMARD_BASE_SIZES)
def test_every_base_matrix_is_hadamard(k):
    h = _base_matrix(k)
    assert h.shape == (k, k) and set(np.unique(h)) <= {-1.0, 1.0}
    np.testing.assert_array_equal(h @ h.T, k * np.eye(k))


@pytest.mark.parametrize("n", sorted(_WILLIAMSON_ROWS))
def test_williamson_rows_are_symmetric(n):
    # The Williamson array is Hadamard only for symmetric circulants; H H^T = K I above checks the sum of squares.
    for row in _WILLIAMSON_ROWS[n]:
        assert len(row) == n and set(row) <= {"+", "-"}
        assert all(row[i] == row[n - i] for i in range(1, n)), row


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
    with pytest.raises(ValueError, match=f"n: expected .* got {n}"):
        ref.hadamard_transform(np.ones((2, n)))


def test_kronecker_order_puts_k_on_the_slow_index():
    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=np.float64)
    np.testing.assert_array_equal(ref.hadamard_matrix(48), np.kron(_base_matrix(12), h4))


@pytest.mark.parametrize("n", [96, 112, 344, 312, 160, 208])
def test_transform_equals_the_matrix_product(n):
    x = RNG.normal(size=(3, n))
    h = ref.hadamard_matrix(n)
    y = ref.hadamard_transform(x)
    np.testing.assert_allclose(y, x @ h.T / np.sqrt(n), atol=1e-12)
    np.testing.assert_allclose(y @ h / np.sqrt(n), x, atol=1e-12)  # orthonormal: the transpose undoes it
    np.testing.assert_allclose(ref.hadamard_transform(x, scale=1.0), x @ h.T, atol=1e-10)


def test_transform_keeps_leading_dims():
    x = RNG.normal(size=(2, 3, 24))
    y = ref.hadamard_transform(x, scale=0.5)
    assert y.shape == x.shape and y.dtype == np.float64
    np.testing.assert_allclose(y, x @ ref.hadamard_matrix(24).T * 0.5, atol=1e-12)
    assert ref.hadamard_transform(np.zeros((0, 24))).shape == (0, 24)


@pytest.mark.parametrize("n", [6144, 7168])
def test_columns_at_model_sizes_are_kronecker_columns(n):
    # The unscaled transform of e_i is column i of H = kron(H_K[:, i // 2^m], H_{2^m}[:, i % 2^m]); checked for a
    # few i without building the n x n matrix. H_12 is not symmetric, so this also pins H versus H^T.
    k = ref.hadamard_base_size(n)
    pow2 = n // k
    sylvester = ref.hadamard_matrix(pow2)
    columns = RNG.choice(n, size=8, replace=False)
    got = ref.hadamard_transform(np.eye(n)[columns], scale=1.0)
    want = np.stack([np.kron(_base_matrix(k)[:, i // pow2], sylvester[:, i % pow2]) for i in columns])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [6144, 7168])
def test_transform_is_orthonormal_at_model_sizes(n):
    x = RNG.normal(size=(4, n))
    y = ref.hadamard_transform(x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-12)
    np.testing.assert_allclose(y @ y.T, x @ x.T, rtol=1e-10, atol=1e-9)  # inner products preserved
