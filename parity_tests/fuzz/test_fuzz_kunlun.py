"""The kunlun backend under the same random valid configs, through the strict vllm-kunlun fake.

The fake (parity_tests/fakes/kunlun) checks every kernel call against the schema rebuilt from the vllm-kunlun wheel
and computes with the reference, so this exercises the adapters: the conversions at the edge (flat cache rows,
lods, max vs scale, lse, scatter vs gather indices), the routing between kernels and the portable path, and the
contract's edge rules (NaN, empty rows, zero rows) on top of the kernels. The cache ops also run with their cache in
every quantized format (int8_index is the one the indexer kernels read). Only the ops the backend maps are
drawn here.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from backends.kunlun.ops import OPS
from fakes.kunlun.fixture import fake_kunlun_fixture, vllm_kunlun_wheel_fixture  # noqa: F401 (pytest fixtures)
from fuzz.strategies import QUANTIZED_CASES, VALID_CASES, FuzzCase, examples
from fuzz.test_fuzz_parity import (
    QUANTIZED_CONFIGS_PER_OP,
    VALID_CONFIGS_PER_OP,
    check_on_backends,
    check_quantized_on_backends,
)
from glm5_hal.kv_formats import OP_CACHE

# The ops the backend maps onto vllm-kunlun kernels; the others are the torch / triton backends' own code on the
# device, fuzzed by test_fuzz_parity.py.
MAPPED = [op for op in OPS if op in VALID_CASES]


@pytest.mark.parametrize("op", MAPPED)
def test_random_valid_configs_match_the_reference_on_kunlun(fake_kunlun, op: str) -> None:
    @settings(max_examples=examples(VALID_CONFIGS_PER_OP), suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=VALID_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_on_backends(case, ["kunlun"])

    holds()


@pytest.mark.parametrize("op", [op for op in OP_CACHE if op in OPS])
def test_random_quantized_cache_configs_match_the_reference_on_kunlun(fake_kunlun, op: str) -> None:
    @settings(
        max_examples=examples(QUANTIZED_CONFIGS_PER_OP), suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(case=QUANTIZED_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_quantized_on_backends(case, ["kunlun"])

    holds()
