"""glm5_hal.vendor_conventions: the conversions every vendor backend applies at its edge, against ops_reference."""

from __future__ import annotations

import math

import numpy as np
import torch

import ops_reference as ref
from glm5_hal.vendor_conventions import contract_empty_rows, contract_quant_scale, lse_from_base2


def test_lse_from_base2_is_the_natural_logsumexp() -> None:
    scores = np.array([[0.5, -1.25, 3.0], [2.0, 2.0, -7.5]])
    base2 = np.log2(np.exp2(scores * math.log2(math.e)).sum(axis=1))  # log2 sum 2^(x log2 e) = log2 sum e^x
    natural = np.log(np.exp(scores).sum(axis=1))
    got = lse_from_base2(torch.tensor(base2, dtype=torch.float32))
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), natural, rtol=1e-6)
    edges = lse_from_base2(torch.tensor([float("-inf"), float("inf"), float("nan")]))
    assert edges[0] == float("-inf") and edges[1] == float("inf") and torch.isnan(edges[2])


def test_contract_quant_scale_applies_the_zero_row_and_nan_rules() -> None:
    q = torch.tensor([[5, -3], [-128, -128], [127, 0], [9, 9]], dtype=torch.int8)
    scale = torch.tensor([0.5, 0.0, 2.0, float("nan")])
    q2, scale2 = contract_quant_scale(q, scale)
    assert q2.tolist() == [[5, -3], [0, 0], [127, 0], [0, 0]]
    assert scale2[:3].tolist() == [0.5, 1.0, 2.0] and torch.isnan(scale2[3])
    want_q, want_scale = ref.dynamic_quant(np.array([[0.0, 0.0], [np.nan, 1.0]]))
    assert float(want_scale[0]) == 1.0 and np.isnan(want_scale[1])  # the rules the conversion implements are the
    assert want_q.tolist() == [[0, 0], [0, 0]]  # reference's


def test_contract_empty_rows_zeroes_empty_softmaxes() -> None:
    out = torch.full((3, 2, 4), float("nan"))
    out[0] = 1.0
    lse = torch.tensor([[0.5, float("-inf")], [float("nan"), float("nan")], [1.0, 2.0]])
    empty = torch.tensor([False, True, False])
    out2, lse2 = contract_empty_rows(out, lse, empty)
    assert lse2[1].tolist() == [float("-inf")] * 2 and lse2[0, 0] == 0.5
    assert (out2[1] == 0).all() and (out2[0, 1] == 0).all() and (out2[0, 0] == 1).all()
    assert torch.isnan(out2[2]).all()  # a token with keys keeps what the kernel computed, NaN included
