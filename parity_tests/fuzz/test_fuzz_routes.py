"""The torch backend on every GEMM route forced, under the same random valid configs as test_fuzz_parity.py.

The probe picks a route per op family on each machine (backends/torch_eager/capabilities.py), so the route a config
takes depends on the CPU; parity must hold on all of them, whichever the probe picks:

    fp32      GLM5_HAL_FAST_PATHS=0
    half      GLM5_HAL_FAST_PATHS=1, GLM5_HAL_NATIVE=0: torch's half GEMM (fp32 result, or rounded + residual)
    native    GLM5_HAL_FAST_PATHS=1 with the native kernels; on a CPU without their instructions, their portable
              builds (GLM5_HAL_NATIVE=portable: the same blocking in scalar C)

The main fuzz tests run the probe's own choice; these run fewer examples per route (the routes share everything
but their GEMMs).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from backends.torch_eager.capabilities import ATTENTION, INDEXER, QUANTIZED_INDEXER, Route
from backends.torch_eager.gemm import forced_route, from_route
from backends.torch_eager.native import amx_gemm, bf16_gemm, build
from fuzz.strategies import QUANTIZED_CASES, VALID_CASES, FuzzCase, examples
from fuzz.test_fuzz_parity import check_on_backends, check_quantized_on_backends
from glm5_hal.registry import OP_NAMES

CONFIGS_PER_ROUTE = 100
QUANTIZED_CONFIGS_PER_ROUTE = 80  # per indexer op: the quantized rows' products alone differ from the above
# The native kernels each op's bf16 / int8 products may reach on the native route (it must reach one, so the route is
# not a no-op). Forced, the native route takes the ops' outputs too (grouped_matmul's products are its outputs; with the
# probe's choice they take it only below the rows where it measured faster than torch's GEMM:
# gemm.Gemm.takes_native). On a CPU with AMX the forced route is AMX's: its GEMM (amx_gemm) under the ops' torch code,
# and its own kernels for sparse attention (amx_attention) and the indexer's scores over bf16 rows (amx_index_scores).
NATIVE_KERNELS = {
    "mla_prolog": ("bf16_gemm", "amx_gemm"),
    "grouped_matmul": ("bf16_gemm", "amx_gemm"),
    # indexer_prolog: its decode-sized calls with contiguous weights take the fused prolog (native/indexer_prolog.c)
    "indexer_prolog": ("indexer_prolog", "bf16_gemm", "amx_gemm"),
    "fused_moe": ("bf16_gemm", "amx_gemm"),
    "indexer_logits": ("indexer_scores", "amx_index_scores"),
    "lightning_indexer": ("indexer_scores", "amx_index_scores"),
    "sparse_flash_attention": ("sparse_attention", "amx_attention"),
    # The first exact int8 route forced: AMX's (its portable build here unless the CPU has AMX), else VNNI's.
    "quant_matmul": ("amx_gemm", "int8_gemm"),
    "w4a8_matmul": ("amx_gemm", "int8_gemm"),
}


def _native_setting() -> str:
    return "1" if bf16_gemm.availability()[0] else build.PORTABLE_ONLY


ROUTES = {
    "fp32": {"GLM5_HAL_FAST_PATHS": "0"},
    "half": {"GLM5_HAL_FAST_PATHS": "1", build.ENV_NATIVE: "0"},
    "native": {"GLM5_HAL_FAST_PATHS": "1", build.ENV_NATIVE: None},  # None: _native_setting()
}


def _forced(route: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Force `route` for the rest of the test; returns the set of native kernels that calls then load."""
    for name, value in ROUTES[route].items():
        monkeypatch.setenv(name, value if value is not None else _native_setting())
    used: set[str] = set()
    real_function = build.function
    monkeypatch.setattr(build, "function", lambda kernel, *a, **kw: used.add(kernel) or real_function(kernel, *a, **kw))
    return used


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_random_valid_configs_hold_on_every_forced_route(op: str, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    used = _forced(route, monkeypatch)  # the native kernels the op's calls loaded

    @settings(max_examples=examples(CONFIGS_PER_ROUTE), suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=VALID_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_on_backends(case, ["torch"], kind=f"route {route}")

    holds()
    if route == "half":
        assert not used, f"GLM5_HAL_NATIVE=0 still ran {used}"
    elif route == "native" and op in NATIVE_KERNELS:
        wanted = NATIVE_KERNELS[op]
        assert used & set(wanted), f"the native route never reached any of {wanted}"
    elif route == "fp32":
        assert used <= {"topk"}, f"the fp32 route ran GEMM kernels {used}"


# The ops with a kernel of their own on AMX's route: (their route family, that kernel).
AMX_KERNELS = {
    "sparse_flash_attention": (ATTENTION, "amx_attention"),
    "indexer_logits": (INDEXER, "amx_index_scores"),
    "lightning_indexer": (INDEXER, "amx_index_scores"),
}
# The same over quantized index rows (the quantized_indexer family's AMX kernel).
AMX_QUANTIZED_KERNEL = (QUANTIZED_INDEXER, "amx_quantized_index_scores")


@pytest.mark.parametrize("op", AMX_KERNELS)
def test_amx_kernels_hold_on_amx_route_anywhere(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX's route runs sparse attention and the indexer's scores over bf16 rows on kernels of their own, which the
    forced native route reaches only on a CPU with AMX: here that route is forced with the kernels' portable builds
    (the tile blocking in scalar C) standing in, so their handling of every layout, padding and NaN canary is fuzzed
    on any CPU."""
    family, kernel = AMX_KERNELS[op]
    used = _forced("native", monkeypatch)
    monkeypatch.setenv(build.ENV_NATIVE, build.PORTABLE_ONLY)  # after _forced, which set the native route's own
    amx = from_route(torch.bfloat16, Route("native", fp32_output=True, isa=amx_gemm.FAST, torch_half=False))

    @settings(max_examples=examples(CONFIGS_PER_ROUTE), suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=VALID_CASES[op].filter(lambda case: case.dtype == torch.bfloat16))
    def holds(case: FuzzCase) -> None:  # bf16 activations: the route is one of the bf16 ones
        check_on_backends(case, ["torch"], kind="route native:amx (portable build)")

    with forced_route(family, amx):
        holds()
    assert kernel in used, f"AMX's route never reached {kernel} (ran {used})"


@pytest.mark.parametrize("op", ["indexer_logits", "lightning_indexer"])
def test_amx_quantized_kernel_holds_on_amx_route_anywhere(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for the indexer over quantized index rows on AMX's route (amx_quantized_index_scores.c: the bf16
    route's dots on tiles), its portable build standing in, with the NaN / inf and zeroed tiles of the quantized
    configs."""
    family, kernel = AMX_QUANTIZED_KERNEL
    used = _forced("native", monkeypatch)
    monkeypatch.setenv(build.ENV_NATIVE, build.PORTABLE_ONLY)
    amx = from_route(torch.bfloat16, Route("native", fp32_output=True, isa=amx_gemm.FAST, torch_half=False))

    @settings(
        max_examples=examples(QUANTIZED_CONFIGS_PER_ROUTE), suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(case=QUANTIZED_CASES[op].filter(lambda case: case.dtype == torch.bfloat16))
    def holds(case: FuzzCase) -> None:
        check_quantized_on_backends(case, ["torch"], kind="route native:amx (portable build)")

    with forced_route(family, amx):
        holds()
    assert kernel in used, f"AMX's route never reached {kernel} (ran {used})"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("op", ["indexer_logits", "lightning_indexer"])
def test_quantized_index_rows_hold_on_every_forced_route(op: str, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The indexer over fp8_index / int8_index rows (the quantized_indexer family: decoded then multiplied, or decoded
    in native/quantized_index_scores.c), with NaN / inf tiles and zeroed tiles; the native route must reach it."""
    used = _forced(route, monkeypatch)

    @settings(
        max_examples=examples(QUANTIZED_CONFIGS_PER_ROUTE), suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(case=QUANTIZED_CASES[op])
    def holds(case: FuzzCase) -> None:
        check_quantized_on_backends(case, ["torch"], kind=f"route {route}")

    holds()
    if route == "native":  # the vector kernel, or on a CPU with AMX (the forced route then is AMX's) its AMX build
        wanted = {"quantized_index_scores", "amx_quantized_index_scores"}
        assert used & wanted, f"the native route never reached any of {wanted}"
    elif route in ("half", "fp32"):
        assert used <= {"topk"}, f"the {route} route ran {used}"
