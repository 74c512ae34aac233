"""Every op x every available backend x dtype x case, against the float64 reference (glm5_hal.parity)."""

from __future__ import annotations

import pytest
import torch

from conftest import parity_backends
from glm5_hal.parity import CASES, parity_device, run_case


def _params():
    for case in CASES:
        for dtype in case.dtypes:
            marks = [pytest.mark.slow] if case.slow else []
            yield pytest.param(case, dtype, id=f"{case.id}-{str(dtype).removeprefix('torch.')}", marks=marks)


@pytest.mark.parametrize("available_backend", parity_backends(), indirect=True)
@pytest.mark.parametrize(("case", "dtype"), list(_params()))
def test_parity(available_backend: str, case, dtype: torch.dtype, request, record_parity) -> None:
    if case.slow and request.config.getoption("--quick"):
        pytest.skip("real-dims case skipped by --quick")
    result = run_case(case, available_backend, dtype, device=parity_device(available_backend))
    record_parity(result)
    if result.status == "not implemented":
        pytest.skip(f"{available_backend} does not implement {case.op} natively: {result.detail}")
    assert result.passed, f"{result.status}: {result.detail} (worst rel err {result.rel_err:.3g})"
