"""Hadamard matrices of order K * 2^m and the orthonormal Hadamard transform (OPS.md section 5, QuaRot).

hadamard_matrix(n) = kron(H_K, H_{2^m}): Sylvester's H_{2^m} on the fast index, a base matrix H_K on the slow
one, with K the largest supported base that divides n with a power-of-two quotient. The base matrices are built
here, each by a classical construction (every one is checked against H H^T = K I by the tests):

- Paley I, order q + 1 for a prime q = 3 (mod 4): 12, 20, 60, 108, 140;
- Paley II, order 2(q + 1) for a prime power q = 1 (mod 4): 28 (q=13), 36 (q=17), 52 (q=25, over GF(25));
- Sylvester doubling: 40 = 2 x 20;
- Williamson array of four symmetric circulants of order n = K/4: 156 (n=39) and 172 (n=43). Their first rows
  are data, not a construction (for these two orders they come from computer searches, not from a formula):
  the four segments of the first row of Sloane's had156 / had172 as QuaRot ships them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

# A GF(q) element: an int mod q for prime q, a pair (x0, x1) = x0 + x1 a for GF(25).
Element = int | tuple[int, int]

HADAMARD_BASE_SIZES = (172, 156, 140, 108, 60, 52, 40, 36, 28, 20, 12, 1)

# First rows of the four symmetric circulants A, B, C, D of order n = K / 4 ("Williamson sequences"). They are
# the four n-long segments of the first row of get_had156() / get_had172() in QuaRot's
# fake_quant/hadamard_utils.py, which cites N. J. A. Sloane's library of Hadamard matrices (had156.will,
# had172.will). Each row is symmetric (row[i] == row[n - i]), as the Williamson construction needs.
_WILLIAMSON_ROWS = {
    39: (
        "+++--+-+-----+--++----++--+-----+-+--++",
        "++++---+--++----+-+--+-+----++--+---+++",
        "+++--++-+---+-+--+----+--+-+---+-++--++",
        "+---++-+-+-----+++-++-+++-----+-+-++---",
    ),
    43: (
        "+---++--++++-+-+++-++--++-+++-+-++++--++---",
        "++-++++++----+-+--++-++-++--+-+----++++++-+",
        "+++-+-++--+-+-++++-+----+-++++-+-+--++-+-++",
        "++---++++-+--+--++--------++--+--+-++++---+",
    ),
}


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_base_size(n: int) -> int | None:
    """The K of n = K * 2^m (the largest supported K), or None when n has no such form."""
    return next((k for k in HADAMARD_BASE_SIZES if n > 0 and n % k == 0 and _is_pow2(n // k)), None)


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _field(
    q: int,
) -> tuple[list[Element], Callable[[Element, Element], Element], Callable[[Element, Element], Element]]:
    """GF(q) for q prime or q = 25 as (elements, sub, mul), zero first. GF(25) = GF(5)[a] with a^2 = 2 (2 is not
    a square mod 5, so the polynomial a^2 - 2 is irreducible); its elements are pairs (x0, x1) = x0 + x1 a."""
    if q == 25:
        elements: list[Element] = [(x0, x1) for x0 in range(5) for x1 in range(5)]

        def sub(x: Element, y: Element) -> Element:
            return ((x[0] - y[0]) % 5, (x[1] - y[1]) % 5)

        def mul(x: Element, y: Element) -> Element:
            return ((x[0] * y[0] + 2 * x[1] * y[1]) % 5, (x[0] * y[1] + x[1] * y[0]) % 5)

        return elements, sub, mul
    return list(range(q)), (lambda x, y: (x - y) % q), (lambda x, y: x * y % q)


def _quadratic_character(q: int) -> tuple[list[Element], Callable[[Element, Element], int]]:
    """(elements of GF(q), chi_diff) with chi_diff(x, y) = chi(y - x): 0 if x == y, 1 if y - x is a nonzero
    square, -1 otherwise."""
    elements, sub, mul = _field(q)
    squares = {mul(x, x) for x in elements[1:]}
    return elements, lambda x, y: 0 if x == y else (1 if sub(y, x) in squares else -1)


def _jacobsthal(q: int) -> np.ndarray:
    """[q, q] with Q[i, j] = chi(e_j - e_i) over GF(q): antisymmetric for q = 3 mod 4, symmetric for q = 1 mod 4."""
    elements, chi_diff = _quadratic_character(q)
    return np.array([[chi_diff(a, b) for b in elements] for a in elements], dtype=np.float64)


def _paley1(q: int) -> np.ndarray:
    """Order q + 1 (q prime, q = 3 mod 4): I + S with S = [[0, 1], [-1, Q]] skew-symmetric."""
    s = np.zeros((q + 1, q + 1))
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
    return np.eye(q + 1) + s


def _paley2(q: int) -> np.ndarray:
    """Order 2(q + 1) (q = 1 mod 4): each entry of the conference matrix C = [[0, 1], [1, Q]] becomes a 2x2
    block: 0 -> [[1, -1], [-1, -1]], +-1 -> +-[[1, 1], [1, -1]]."""
    c = np.zeros((q + 1, q + 1))
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
    return np.kron(c, np.array([[1, 1], [1, -1]])) + np.kron(np.eye(q + 1), np.array([[1, -1], [-1, -1]]))


def _williamson(n: int) -> np.ndarray:
    """Order 4n: [[A, B, C, D], [-B, A, -D, C], [-C, D, A, -B], [-D, -C, B, A]]. Circulants commute and these are
    symmetric, so H H^T is block diagonal with blocks A^2 + B^2 + C^2 + D^2, which the rows make 4n I."""

    def circulant(row: str) -> np.ndarray:
        first = np.array([1.0 if ch == "+" else -1.0 for ch in row])
        return np.stack([np.roll(first, i) for i in range(n)])

    a, b, c, d = map(circulant, _WILLIAMSON_ROWS[n])
    return np.block([[a, b, c, d], [-b, a, -d, c], [-c, d, a, -b], [-d, -c, b, a]])


_BASE_CONSTRUCTIONS = {
    1: lambda: np.ones((1, 1)),
    12: lambda: _paley1(11),
    20: lambda: _paley1(19),
    28: lambda: _paley2(13),
    36: lambda: _paley2(17),
    40: lambda: np.kron(_sylvester(2), _paley1(19)),
    52: lambda: _paley2(25),
    60: lambda: _paley1(59),
    108: lambda: _paley1(107),
    140: lambda: _paley1(139),
    156: lambda: _williamson(39),
    172: lambda: _williamson(43),
}


@functools.cache
def _base_matrix(k: int) -> np.ndarray:
    h = _BASE_CONSTRUCTIONS[k]()
    h.setflags(write=False)
    return h


def _factors(n: int) -> tuple[int, int]:
    """(K, 2^m) with n = K * 2^m, or a ValueError naming n."""
    k = hadamard_base_size(n)
    if k is None:
        raise ValueError(f"n: expected K * 2^m with K in {sorted(HADAMARD_BASE_SIZES)}, got {n}")
    return k, n // k


def hadamard_matrix(n: int) -> np.ndarray:
    """The unnormalised +-1 Hadamard matrix [n, n] float64 = kron(H_K, H_{2^m}) for n = K * 2^m.

    ValueError naming n when n has no such form (see hadamard_base_size)."""
    k, pow2 = _factors(n)
    return np.kron(_base_matrix(k), _sylvester(pow2))


def hadamard_transform(x: np.ndarray, *, scale: float | None = None) -> np.ndarray:
    """y [..., n] float64 = x [..., n] @ hadamard_matrix(n)^T * scale, over the last dim of x (any leading dims).

    scale: None means 1/sqrt(n), which makes the transform orthonormal (x == y @ hadamard_matrix(n) / sqrt(n)).

    Computed as H_K X H_{2^m}^T on x viewed [..., K, 2^m], which is the same product without the n x n matrix.
    """
    x = np.asarray(x, np.float64)
    n = x.shape[-1]
    k, pow2 = _factors(n)
    blocks = x.reshape(*x.shape[:-1], k, pow2)
    y = np.einsum("ij,...jm,lm->...il", _base_matrix(k), blocks, _sylvester(pow2), optimize=True)
    return y.reshape(x.shape) * (1.0 / math.sqrt(n) if scale is None else scale)
