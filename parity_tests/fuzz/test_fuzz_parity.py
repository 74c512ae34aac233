"""Random valid configs of every op on every available backend, judged against the float64 reference.

One hypothesis example is one config; it runs on each backend (reference, torch, triton under its CPU
interpreter), through the parity suite's judge (glm5_hal.parity.runner.run_inputs): every output within the
dtype's tolerance of ops_reference, NaN / inf positions identical, top-k sets through the reference scores, written
caches checked through their views, and every argument the op only reads left unchanged.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from conftest import parity_backends
from fuzz.strategies import FUZZ_COUNTS, VALID_CASES, FuzzCase, examples
from glm5_hal.parity.runner import run_inputs
from glm5_hal.registry import OP_NAMES, registry

# The backends the fuzz suite runs here: the portable ones that run on a CPU. The ascend backend runs its
# fused-kernel adapters against the strict torch_npu fake in test_fuzz_ascend.py; the vendor backends run these
# same torch / triton functions.
FUZZ_BACKENDS = ("reference", "torch", "triton")
VALID_CONFIGS_PER_OP = 200


def fuzz_backends() -> list[str]:
    wanted = [b for b in parity_backends() if b in FUZZ_BACKENDS]
    return [b for b in wanted if registry().availability(b).available]


def check_on_backends(case: FuzzCase, backends: list[str], kind: str = "parity") -> None:
    for backend in backends:
        result = run_inputs(case.op, case.inputs, backend, case.dtype, layouts=case.layouts)
        FUZZ_COUNTS[(kind, case.op, backend)] += 1
        assert result.passed, f"{backend}: {result.status}: {result.detail}\n{case!r}"


@pytest.mark.parametrize("op", OP_NAMES)
def test_random_valid_configs_match_the_reference(op: str) -> None:
    backends = fuzz_backends()
    if not backends:
        pytest.skip(f"none of {FUZZ_BACKENDS} is available here (GLM5_HAL_BACKEND={parity_backends()})")

    @settings(max_examples=examples(VALID_CONFIGS_PER_OP))
    @given(case=VALID_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_on_backends(case, backends)

    holds()
