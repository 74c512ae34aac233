"""The metax backend under the same random valid configs, through the strict MetaX fake (mcoplib, mcFlashMLA).

The fake (parity_tests/fakes/metax) checks every call against MetaX's published schema and source checks and
computes with the reference, so this exercises the adapters: conversions at the edge (flat slots, base-2 lse,
lengths), the routing between the vendor kernels and the portable path, and the contract's edge rules on top of the
kernels. Only the ops mapped onto MetaX kernels run here; the others are the portable delegates, fuzzed on their
own backends. The cache readers also run with their cache in every quantized format (which read on the portable
path: mcFlashMLA reads float rows only).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from backends.metax.ops import MAPPED
from fakes.metax.fixture import fake_metax_fixture  # noqa: F401 (pytest fixture)
from fuzz.strategies import QUANTIZED_CASES, VALID_CASES, FuzzCase, examples
from fuzz.test_fuzz_parity import (
    QUANTIZED_CONFIGS_PER_OP,
    VALID_CONFIGS_PER_OP,
    check_on_backends,
    check_quantized_on_backends,
)
from glm5_hal.kv_formats import OP_CACHE


@pytest.mark.parametrize("op", list(MAPPED))
def test_random_valid_configs_match_the_reference_on_metax(fake_metax, op: str) -> None:
    @settings(max_examples=examples(VALID_CONFIGS_PER_OP), suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=VALID_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_on_backends(case, ["metax"])

    holds()


@pytest.mark.parametrize("op", [op for op in OP_CACHE if op in MAPPED])
def test_random_quantized_cache_configs_match_the_reference_on_metax(fake_metax, op: str) -> None:
    @settings(
        max_examples=examples(QUANTIZED_CONFIGS_PER_OP), suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(case=QUANTIZED_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_quantized_on_backends(case, ["metax"])

    holds()


def test_the_fuzzed_configs_reach_the_metax_kernels(fake_metax) -> None:
    """The profile above is not all portable: the small drawn shapes reach these kernels."""

    @settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)
    @given(case=VALID_CASES["dynamic_quant"])
    def quant(case: FuzzCase) -> None:
        check_on_backends(case, ["metax"])

    quant()
    assert fake_metax.calls["dynamic_scaled_int8_quant"] > 0
