"""The ascend backend under the same random valid configs, through the strict torch_npu fake.

The fake (parity_tests/fakes/ascend) checks every torch_npu call against the documented schema and computes with
the reference, so this exercises the adapters: layout conversions, the routing between fused kernels and the
portable path, and the contract's edge rules (NaN, empty rows, -1 slots) on top of the kernels. Most tiny fuzz
shapes fall outside the fused kernels' documented ranges and take the portable path; test_ascend.py runs the
fused kernels at their real shapes. The cache ops also run with their cache in every quantized format.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from fakes.ascend.fixture import fake_torch_npu_fixture, torch_npu_schemas_fixture  # noqa: F401 (pytest fixtures)
from fuzz.strategies import QUANTIZED_CASES, VALID_CASES, FuzzCase, examples
from fuzz.test_fuzz_parity import (
    QUANTIZED_CONFIGS_PER_OP,
    VALID_CONFIGS_PER_OP,
    check_on_backends,
    check_quantized_on_backends,
)
from glm5_hal.kv_formats import OP_CACHE
from glm5_hal.registry import OP_NAMES


@pytest.mark.parametrize("op", OP_NAMES)
def test_random_valid_configs_match_the_reference_on_ascend(fake_torch_npu, op: str) -> None:
    @settings(max_examples=examples(VALID_CONFIGS_PER_OP), suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=VALID_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_on_backends(case, ["ascend"])

    holds()


@pytest.mark.parametrize("op", list(OP_CACHE))
def test_random_quantized_cache_configs_match_the_reference_on_ascend(fake_torch_npu, op: str) -> None:
    @settings(
        max_examples=examples(QUANTIZED_CONFIGS_PER_OP), suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(case=QUANTIZED_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_quantized_on_backends(case, ["ascend"])

    holds()
