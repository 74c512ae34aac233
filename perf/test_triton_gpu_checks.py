"""perf/triton_gpu.py's check of the grouped GEMM targets: it passes a right output and names a wrong one.

The script itself needs a GPU (or its slow --mini run under the interpreter); its check runs anywhere, here on
outputs computed with torch, so these tests are fast and need no Triton.
"""

from __future__ import annotations

import pytest
import torch

from perf.triton_gpu import _checked_rows, check_grouped

EXPERTS, N, K = 4, 24, 40
OFFSETS = torch.tensor([0, 5, 5, 6, 19])  # an expert with no rows and one with a single row


def _grouped_bf16(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(int(OFFSETS[-1]), K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(EXPERTS, N, K, generator=gen) * K**-0.5).to(torch.bfloat16)
    y = torch.empty(x.shape[0], N, dtype=torch.bfloat16)
    for e in range(EXPERTS):
        lo, hi = int(OFFSETS[e]), int(OFFSETS[e + 1])
        y[lo:hi] = (x[lo:hi].float() @ w[e].float().T).to(torch.bfloat16)
    return y, x, w


def _grouped_w8a8(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x_q = torch.randint(-127, 128, (int(OFFSETS[-1]), K), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (EXPERTS, N, K), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(x_q.shape[0], generator=gen) * 0.01, torch.rand(EXPERTS, N, generator=gen) * 0.01
    y = torch.empty(x_q.shape[0], N, dtype=torch.bfloat16)
    for e in range(EXPERTS):
        lo, hi = int(OFFSETS[e]), int(OFFSETS[e + 1])
        acc = x_q[lo:hi].double() @ w_q[e].double().T
        y[lo:hi] = (acc * x_scale[lo:hi, None].double() * w_scale[e, None].double()).to(torch.bfloat16)
    return y, x_q, w_q, x_scale, w_scale


def test_checked_rows_hold_every_expert_edge() -> None:
    picked = dict((e, rows.tolist()) for e, rows in _checked_rows(OFFSETS, 4))
    assert picked == {0: [0, 1, 3, 4], 2: [5], 3: [6, 10, 14, 18]}  # expert 1 has no rows
    assert dict((e, rows.tolist()) for e, rows in _checked_rows(OFFSETS, 100))[0] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("row", [4, 5, 18])  # an expert's last row, a one-row expert, the last row of all
def test_grouped_bf16_check(row: int) -> None:
    y, x, w = _grouped_bf16(torch.Generator().manual_seed(row))
    assert check_grouped(y, x, w, OFFSETS) == "ok"
    wrong = y.clone()
    wrong[row, 3] += 0.25 * y.float().abs().max().to(torch.bfloat16)
    assert check_grouped(wrong, x, w, OFFSETS) != "ok"
    swapped = y.clone()  # rows computed with the next expert's weights: the bug a wrong tile index makes
    e = int(torch.searchsorted(OFFSETS, torch.tensor(row), right=True)) - 1
    swapped[row] = (x[row].float() @ w[(e + 1) % EXPERTS].float().T).to(torch.bfloat16)
    assert check_grouped(swapped, x, w, OFFSETS) != "ok"


def test_grouped_w8a8_check() -> None:
    y, x_q, w_q, x_scale, w_scale = _grouped_w8a8(torch.Generator().manual_seed(1))
    assert check_grouped(y, x_q, w_q, OFFSETS, x_scale=x_scale, w_scale=w_scale) == "ok"
    scaled_twice = y.clone()
    scaled_twice[6:19] = scaled_twice[6:19] * 2  # one expert's rows off by a factor of 2, as a scale applied twice
    assert check_grouped(scaled_twice, x_q, w_q, OFFSETS, x_scale=x_scale, w_scale=w_scale) != "ok"
    nan = y.clone()
    nan[0, 0] = float("nan")
    assert "inf/nan" in check_grouped(nan, x_q, w_q, OFFSETS, x_scale=x_scale, w_scale=w_scale)
