"""The metax backend under the same random valid configs, through the strict MetaX fake (mcoplib, mcFlashMLA).

The fake (parity_tests/fakes/metax) checks every call against MetaX's published schema and source checks and
computes with the reference, so this exercises the adapters: conversions at the edge (flat slots, base-2 lse,
lengths), the routing between the vendor kernels and the portable path, and the contract's edge rules on top of the
kernels. Only the ops mapped onto MetaX kernels run here; the others are the portable delegates, fuzzed on their
own backends.

Some drawn configs never fit a MetaX kernel (PORTABLE_DRAWS, and every quantized cache: mcFlashMLA reads float rows
only, the indexer scores are portable). For those the test here shows that the adapter hands them to the portable
op and no MetaX kernel runs; their arithmetic is the torch / triton backends', fuzzed by test_fuzz_parity.py (its
quantized-cache fuzz included), and test_metax.py's parity cases reach each kernel at the shapes it takes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from backends.metax import attention, quant, runtime, topk
from backends.metax.ops import MAPPED
from fakes.metax.fixture import fake_metax_fixture  # noqa: F401 (pytest fixture)
from fuzz.strategies import QUANTIZED_CASES, VALID_CASES, FuzzCase, examples
from fuzz.test_fuzz_parity import VALID_CONFIGS_PER_OP, check_on_backends, check_quantized_on_backends
from glm5_hal.kv_formats import OP_CACHE

# The fuzz draws tiny dims and small k (fuzz/strategies.py): rows never mcFlashMLA's 576 wide, k never fast_topk's
# 2048, N never cutlass_scaled_mm's multiple of 16 (200 draws of each: all on the portable path).
PORTABLE_DRAWS = ("sparse_flash_attention", "lightning_indexer", "quant_matmul")
KERNEL_DRAWS = [op for op in MAPPED if op not in PORTABLE_DRAWS]
ROUTED = [(op, "valid") for op in PORTABLE_DRAWS] + [(op, "quantized") for op in OP_CACHE if op in MAPPED]
ROUTED_EXAMPLES = 12


@pytest.mark.parametrize("op", KERNEL_DRAWS)
def test_random_valid_configs_match_the_reference_on_metax(fake_metax, op: str) -> None:
    @settings(max_examples=examples(VALID_CONFIGS_PER_OP), suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=VALID_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_on_backends(case, ["metax"])

    holds()


@pytest.mark.parametrize(("op", "kind"), ROUTED, ids=[f"{op}-{kind}" for op, kind in ROUTED])
def test_configs_no_kernel_takes_run_the_portable_op_on_metax(fake_metax, monkeypatch, op: str, kind: str) -> None:
    """Drawn configs outside every MetaX kernel's range: the adapter hands each to the portable op, no MetaX kernel
    runs, and the answer matches the reference."""
    handed: list[str] = []

    def spy(name: str, reason: str):
        handed.append(name)
        return runtime.portable(name, reason)

    for adapter in (attention, quant, topk):
        monkeypatch.setattr(adapter, "portable", spy)
    check = check_on_backends if kind == "valid" else check_quantized_on_backends

    @settings(
        max_examples=ROUTED_EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True
    )
    @given(case=(VALID_CASES if kind == "valid" else QUANTIZED_CASES)[op])
    def routed(case: FuzzCase) -> None:
        fake_metax.reset()
        handed.clear()
        check(case, ["metax"])
        assert handed and handed[0] in (op, "indexer_logits"), f"{op} did not reach the portable op: {handed}"
        assert not +fake_metax.calls, f"a MetaX kernel ran: {dict(fake_metax.calls)}\n{case!r}"

    routed()


def test_the_fuzzed_configs_reach_the_metax_kernels(fake_metax) -> None:
    """The profile above is not all portable: the small drawn shapes reach these kernels."""

    @settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)
    @given(case=VALID_CASES["dynamic_quant"])
    def quant(case: FuzzCase) -> None:
        check_on_backends(case, ["metax"])

    @settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)
    @given(case=VALID_CASES["moe_gate"])
    def gate(case: FuzzCase) -> None:
        check_on_backends(case, ["metax"])

    quant()
    gate()
    assert fake_metax.calls["dynamic_scaled_int8_quant"] > 0
    assert fake_metax.calls["grouped_topk"] + fake_metax.calls["moe_fused_gate"] > 0
