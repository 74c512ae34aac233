"""The `metax` backend without MetaX hardware: the parity suite on a strict fake of mcoplib and mcFlashMLA.

The fake (parity_tests/fakes/metax) defines each op the backend calls from the schema string MetaX publishes
(written into the project with its source and commit), refuses what the sources' checks refuse and computes with
ops_reference; docs/vendors.md says what this does and does not prove.

    pytest parity_tests/test_metax.py parity_tests/fuzz/test_fuzz_metax.py [--quick]
"""

from __future__ import annotations

import pytest
import torch

import glm5_hal
from fakes.metax import ops as fake_ops
from fakes.metax.common import FakeMetaxError
from fakes.metax.fixture import fake_metax_fixture  # noqa: F401 (pytest fixture)
from glm5_hal.cli.info import collect, op_table, report_data
from glm5_hal.parity import CASES, run_case
from glm5_hal.parity.inputs import SeqSpec, paged_batch
from glm5_hal.selection import use_backend

BF16, FP32, BOTH = ("bfloat16",), ("float32",), ("float32", "bfloat16")
MAPPED = ("sparse_flash_attention", "lightning_indexer", "moe_gate", "dynamic_quant", "quant_matmul")


def expected_kernels(case, dtype_name: str) -> set[str]:
    """The fake kernels `case` must reach in `dtype_name` (empty: the portable path), from the adapters' rules."""
    op = case.op
    if op == "dynamic_quant":
        return {"dynamic_scaled_int8_quant"}
    if op == "moe_gate":
        return set() if "softmax" in case.name else {"grouped_topk", "moe_fused_gate"}
    if op == "quant_matmul":
        return {"cutlass_scaled_mm"} if dtype_name == "bfloat16" else set()
    if op == "lightning_indexer":
        return {"fast_topk"} if "topk2048" in case.name else set()
    if op == "sparse_flash_attention":
        quantized = case.name.endswith(("fp8_ds_mla", "int8_mla"))
        return set() if quantized or dtype_name != "bfloat16" else {"sparse_prefill_fwd", "fwd_kvcache_mla"}
    return set()


def _params():
    for case in CASES:
        if case.op not in MAPPED:
            continue
        for dtype in case.dtypes:
            marks = [pytest.mark.slow] if case.slow else []
            yield pytest.param(case, dtype, id=f"{case.id}-{str(dtype).removeprefix('torch.')}", marks=marks)


@pytest.mark.parametrize(("case", "dtype"), list(_params()))
def test_metax_parity(fake_metax, case, dtype, request, record_parity) -> None:
    if case.slow and request.config.getoption("--quick"):
        pytest.skip("real-dims case skipped by --quick")
    result = run_case(case, "metax", dtype, device="cpu")
    record_parity(result)
    assert result.passed, f"{result.status}: {result.detail} (worst rel err {result.rel_err:.3g})"
    want = expected_kernels(case, result.dtype)
    ran = {name for name, count in fake_metax.calls.items() if count and name != "get_mla_metadata"}
    if want:
        assert ran and ran <= want, f"expected one of {want} to run, ran {dict(fake_metax.calls)}"
    else:
        assert not ran, f"expected the portable path, but ran {dict(fake_metax.calls)}"
