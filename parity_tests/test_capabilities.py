"""The capability probe (backends.torch_eager.capabilities) and the exact int8 GEMM routes
(backends.torch_eager.int8_gemms).

- Decisions from faked facts and a faked probe: a CPU without bf16 / int8 flags keeps the conservative path and
  measures nothing; flags plus a measured win take the fast path; flags with a measured loss do not; an inexact
  int8 route is never used; known accelerators are trusted without timing; fp16 needs an fp32-result GEMM;
  GLM5_HAL_FAST_PATHS=0 / 1 / bad values.
- CPU flag parsing (x86 and Arm /proc/cpuinfo), the per-process cache.
- The real int8 routes on this machine: bit-exact at K = 16384 and 40960 with -128 / 127 codes, and the
  exactness check catches a GEMM that saturates like AVX2's 16-bit pair sums.
"""

from __future__ import annotations

import json

import pytest
import torch

from backends.torch_eager import capabilities as caps
from backends.torch_eager import int8_gemms
from backends.torch_eager.capabilities import AUTO, FORCE, DeviceFacts, DeviceProbe, decide
from backends.torch_eager.native import build
from glm5_hal.cli import main
from glm5_hal.cli.info import report_data

AVX2_ZEN3 = "model name\t: AMD EPYC 7B13\ncpu family\t: 25\nflags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n"
ZEN5 = (
    "model name\t: AMD EPYC\ncpu family\t: 26\nflags\t\t: avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni avx_vnni\n"
)
SAPPHIRE_RAPIDS = "model name\t: Intel Xeon\nflags\t\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd asimdhp asimddp bf16 i8mm sve\n"
ONEDNN, INT_MM = int8_gemms.ONEDNN_U8S8.name, int8_gemms.INT_MM.name
NATIVE_INT8 = int8_gemms.NATIVE_VNNI.name


class FakeProbe:
    """Measurements on demand, with a record of what was asked (a decision that needs none must ask nothing)."""

    def __init__(
        self,
        half: dict[torch.dtype, float] | None = None,
        fp32_output: bool = False,
        exact: dict[str, bool] | None = None,
        int8: dict[str, float] | None = None,
        residual_exact: bool = True,
        min_rows: int = 1,
        native: tuple[bool, str] = (False, "no native kernel in this fake"),
        native_speedup: float = 0.0,
        streaming_rows: int = 0,
    ) -> None:
        self.half, self._fp32_output, self._residual_exact = half or {}, fp32_output, residual_exact
        self._min_rows = min_rows
        self._native, self._native_speedup = native, native_speedup
        self.exact, self.int8 = exact or {}, int8 or {}
        self._streaming_rows = streaming_rows
        self.asked: list[str] = []

    def half_speedup(self, dtype: torch.dtype) -> float:
        self.asked.append(f"half_speedup {dtype}")
        return self.half[dtype]

    def fp32_output(self, dtype: torch.dtype) -> bool:
        self.asked.append(f"fp32_output {dtype}")
        return self._fp32_output

    def native_gemm(self, dtype: torch.dtype) -> tuple[bool, str]:
        self.asked.append(f"native_gemm {dtype}")
        return self._native

    def native_speedup(self, dtype: torch.dtype) -> float:
        self.asked.append(f"native_speedup {dtype}")
        return self._native_speedup

    def residual_exact(self, dtype: torch.dtype) -> bool:
        self.asked.append(f"residual_exact {dtype}")
        return self._residual_exact

    def residual_min_rows(self, dtype: torch.dtype) -> int:
        self.asked.append(f"residual_min_rows {dtype}")
        return self._min_rows

    def int8_exact(self, route: int8_gemms.Int8Gemm) -> tuple[bool, str]:
        self.asked.append(f"int8_exact {route.name}")
        ok = self.exact.get(route.name, False)
        return ok, "exact" if ok else "17 of 85 accumulators differ"

    def int8_speedup(self, route: int8_gemms.Int8Gemm) -> float:
        self.asked.append(f"int8_speedup {route.name}")
        return self.int8[route.name]

    def int8_streaming_rows(self, route: int8_gemms.Int8Gemm, general: int8_gemms.Int8Gemm) -> int:
        self.asked.append(f"int8_streaming_rows {route.name} vs {general.name}")
        return self._streaming_rows


def _cpu(cpuinfo: str) -> DeviceFacts:
    return caps.cpu_facts(cpuinfo)


# ------------------------------------------------------------------------------------------------ decisions


def test_cpu_without_bf16_or_int8_units_keeps_the_conservative_path_and_measures_nothing():
    probe = FakeProbe()  # any measurement would raise KeyError: nothing is configured
    got = decide(_cpu(AVX2_ZEN3), probe, AUTO)
    assert probe.asked == []
    assert not any(choice.use for choice in got.half.values())
    assert got.int8.route is None and got.int8_route() is None
    assert "no CPU flag avx512_bf16" in got.half[torch.bfloat16].reason
    assert "no int8 dot-product units" in got.int8.reason
    # The same choices as GLM5_HAL_FAST_PATHS=0: the backend runs exactly the conservative code.
    off = caps.capabilities("cpu", "0")
    assert [c.use for c in got.half.values()] == [c.use for c in off.half.values()]
    assert got.int8.route == off.int8.route is None


def test_a_rounded_result_that_cannot_be_recovered_keeps_the_conservative_path():
    """bf16 GEMMs that return bf16 only, on a device whose addmm rounds before it adds: every intermediate would be
    rounded, so the half path is refused before anything is timed, in every mode (=1 included)."""
    for mode in (AUTO, FORCE):
        probe = FakeProbe(half={torch.bfloat16: 4.0}, residual_exact=False)
        bf16 = decide(_cpu(ZEN5), probe, mode).half[torch.bfloat16]
        assert not bf16.use and "addmm rounds before it adds" in bf16.reason
        assert "residual_exact torch.bfloat16" in probe.asked
        assert "half_speedup torch.bfloat16" not in probe.asked
    # With an fp32-result GEMM the residual is not needed, and not asked for.
    probe = FakeProbe(half={torch.bfloat16: 4.0}, fp32_output=True, residual_exact=False, min_rows=8)
    bf16 = decide(_cpu(ZEN5), probe, AUTO).half[torch.bfloat16]
    assert bf16.use and bf16.min_rows == 1
    assert "residual_exact torch.bfloat16" not in probe.asked and "residual_min_rows torch.bfloat16" not in probe.asked


def test_the_residual_path_keeps_fp32_below_the_measured_row_count():
    """Two passes over the weight cost more than bf16 saves where rows are few: the probe's row count is kept (AUTO),
    and =1 takes the half path at every row count."""
    bf16 = decide(_cpu(ZEN5), FakeProbe(half={torch.bfloat16: 4.0}, min_rows=8), AUTO).half[torch.bfloat16]
    assert bf16.use and bf16.min_rows == 8 and "fp32 below 8 rows" in bf16.path
    assert decide(_cpu(ZEN5), FakeProbe(min_rows=8), FORCE).half[torch.bfloat16].min_rows == 1


def test_products_whose_extra_work_outweighs_the_measured_speedup_keep_fp32():
    """The measured bf16 / fp32 ratio over MIN_SPEEDUP bounds the work a product may take on the half path (parts of
    fp32 operands times the residual's pass); =1 and devices trusted without timing have no bound."""
    bf16 = decide(_cpu(ZEN5), FakeProbe(half={torch.bfloat16: 4.0}), AUTO).half[torch.bfloat16]
    assert bf16.use and bf16.max_work == pytest.approx(4.0 / caps.MIN_SPEEDUP) and "3.2x their work" in bf16.path
    assert decide(_cpu(ZEN5), FakeProbe(), FORCE).half[torch.bfloat16].max_work == float("inf")
    cuda = caps.DeviceFacts(
        "cuda", "CUDA sm_90", {u: True for u in caps.UNITS}, {u: "sm_90" for u in caps.UNITS}, False
    )
    trusted = decide(cuda, FakeProbe(fp32_output=True), AUTO).half[torch.bfloat16]
    assert trusted.use and trusted.max_work == float("inf") and "their work" not in trusted.path


NATIVE_OK = (True, "bf16_gemm_avx512_bf16, fp32 sums of exact bf16 products")


def test_a_native_fp32_result_gemm_replaces_the_residual():
    """Where torch's bf16 GEMM returns bf16 only but the native kernel runs and is exact, products come back in fp32
    in one pass: no residual, no row threshold, and the speed that bounds their work is the native kernel's."""
    probe = FakeProbe(half={torch.bfloat16: 4.0}, native=NATIVE_OK, native_speedup=3.0, min_rows=8)
    got = decide(_cpu(ZEN5), probe, AUTO)
    bf16 = got.half[torch.bfloat16]
    assert bf16.use and bf16.native and bf16.fp32_output and bf16.min_rows == 1
    assert bf16.max_work == pytest.approx(3.0 / caps.MIN_SPEEDUP)
    assert "native kernel" in bf16.path and "bf16_gemm_avx512_bf16" in bf16.reason and "3.00x" in bf16.reason
    assert got.measured["bfloat16 native GEMM"] == 3.0
    for unasked in ("residual_exact", "residual_min_rows", "half_speedup"):
        assert f"{unasked} torch.bfloat16" not in probe.asked
    # =1 takes it untimed; fp16 never asks for it (the kernel is bf16 only).
    forced = FakeProbe(native=NATIVE_OK)
    assert decide(_cpu(ZEN5), forced, FORCE).half[torch.bfloat16].native
    assert "native_speedup torch.bfloat16" not in forced.asked and "native_gemm torch.float16" not in forced.asked


def test_a_native_kernel_that_is_slow_or_missing_is_not_used():
    slow = decide(_cpu(ZEN5), FakeProbe(native=NATIVE_OK, native_speedup=1.1), AUTO).half[torch.bfloat16]
    assert not slow.use and not slow.native and "native GEMM measured 1.10x" in slow.reason
    why = "bf16_gemm_avx512_bf16 needs CPU flags avx512_bf16, which this CPU does not list"
    missing = decide(_cpu(ZEN5), FakeProbe(half={torch.bfloat16: 4.0}, native=(False, why)), AUTO)
    bf16 = missing.half[torch.bfloat16]
    assert bf16.use and not bf16.native and not bf16.fp32_output and why in bf16.reason
    # A GEMM that hands back fp32 itself (CUDA's out_dtype) needs no native kernel: it is not even asked.
    probe = FakeProbe(half={torch.bfloat16: 4.0}, fp32_output=True, native=NATIVE_OK)
    assert not decide(_cpu(ZEN5), probe, AUTO).half[torch.bfloat16].native
    assert "native_gemm torch.bfloat16" not in probe.asked


def test_glm5_hal_native_0_turns_the_native_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The escape hatch for the native kernels: the real probe reports it as the reason, and the per-process cache
    answers per setting (a choice made with the kernel on is not reused with it off)."""
    monkeypatch.setenv("GLM5_HAL_NATIVE", "0")
    ok, why = DeviceProbe(torch.device("cpu")).native_gemm(torch.bfloat16)
    assert not ok and why == "GLM5_HAL_NATIVE=0"
    off = caps.capabilities("cpu", FORCE).half[torch.bfloat16]
    assert not off.native and "GLM5_HAL_NATIVE=0" in off.reason
    monkeypatch.delenv("GLM5_HAL_NATIVE")
    on = caps.capabilities("cpu", FORCE).half[torch.bfloat16]
    assert on.native == (on.fp32_output and not DeviceProbe(torch.device("cpu")).fp32_output(torch.bfloat16))
    assert on.native == DeviceProbe(torch.device("cpu")).native_gemm(torch.bfloat16)[0]


def test_the_real_probe_sees_this_cpus_addmm_add_in_fp32_or_refuses() -> None:
    """DeviceProbe.residual_exact on this machine agrees with a direct measurement of the recovered product."""
    probe = DeviceProbe(torch.device("cpu"))
    a, b = torch.randn(8, 512).bfloat16(), torch.randn(512, 32).bfloat16()
    rounded = a @ b
    recovered = rounded.double() + torch.addmm(rounded, a, b, beta=-1).double()
    want = a.double() @ b.double()
    measured = bool((recovered - want).abs().amax() <= 2.0**-13 * want.abs().amax())
    assert probe.residual_exact(torch.bfloat16) == measured


def test_cpu_with_units_and_a_measured_win_takes_the_fast_paths():
    probe = FakeProbe(half={torch.bfloat16: 4.0}, exact={ONEDNN: True, INT_MM: True}, int8={ONEDNN: 6.0, INT_MM: 7.0})
    got = decide(_cpu(ZEN5), probe, AUTO)
    bf16, fp16 = got.half[torch.bfloat16], got.half[torch.float16]
    assert bf16.use and not bf16.fp32_output and "rounding residual" in bf16.path
    assert "avx512_bf16" in bf16.reason and "4.00x" in bf16.reason
    assert not fp16.use and "no CPU flag avx512_fp16" in fp16.reason
    # Routes are taken in order of preference among the exact ones that win, not by the probe shape's speed alone.
    assert got.int8.route == ONEDNN and got.int8_route() is int8_gemms.ONEDNN_U8S8
    assert got.measured == {"bfloat16 GEMM": 4.0, f"{ONEDNN} (int8)": 6.0}


def test_cpu_flags_without_a_measured_win_keep_the_conservative_path():
    probe = FakeProbe(half={torch.bfloat16: 0.9}, exact={ONEDNN: True, INT_MM: True}, int8={ONEDNN: 1.1, INT_MM: 0.2})
    got = decide(_cpu(ZEN5), probe, AUTO)
    assert not got.half[torch.bfloat16].use and "0.90x" in got.half[torch.bfloat16].reason
    assert got.int8.route is None and ">= 1.25x" in got.int8.reason


def test_the_native_int8_kernel_takes_the_row_counts_it_measured_faster_for():
    exact = {ONEDNN: True, NATIVE_INT8: True, INT_MM: True}
    probe = FakeProbe(half={torch.bfloat16: 4.0}, exact=exact, int8={ONEDNN: 6.0}, streaming_rows=4)
    got = decide(_cpu(ZEN5), probe, AUTO).int8
    assert got.route == ONEDNN and got.native_rows == 4
    assert [got.takes_native(rows) for rows in (0, 1, 4, 5, 64)] == [False, True, True, False, False]
    assert f"{NATIVE_INT8} up to 4 rows" in got.path and "up to 4 rows (weight from memory)" in got.native_reason
    assert f"int8_streaming_rows {NATIVE_INT8} vs {ONEDNN}" in probe.asked
    # Slower at one row already: never used, and the reason says so.
    slower = decide(_cpu(ZEN5), FakeProbe(half={torch.bfloat16: 4.0}, exact=exact, int8={ONEDNN: 6.0}), AUTO).int8
    assert slower.native_rows == 0 and not slower.takes_native(1) and "slower" in slower.native_reason
    # Not exact (or not built here): not measured, not used.
    inexact = FakeProbe(half={torch.bfloat16: 4.0}, exact={ONEDNN: True}, int8={ONEDNN: 6.0}, streaming_rows=4)
    got = decide(_cpu(ZEN5), inexact, AUTO).int8
    assert got.native_rows == 0 and not any("streaming" in asked for asked in inexact.asked)
    # Forced fast paths measure nothing, so the general route takes every row count.
    forced = decide(_cpu(ZEN5), FakeProbe(exact=exact, streaming_rows=4), FORCE).int8
    assert forced.route == ONEDNN and forced.native_rows == 0


def test_the_native_int8_kernel_as_the_general_route_takes_every_row_count():
    probe = FakeProbe(half={torch.bfloat16: 4.0}, exact={NATIVE_INT8: True}, int8={NATIVE_INT8: 5.0})
    got = decide(_cpu(ZEN5), probe, AUTO).int8
    assert got.route == NATIVE_INT8 and got.takes_native(1) and got.takes_native(4096)
    assert not any("streaming" in asked for asked in probe.asked)


def test_an_inexact_int8_route_is_never_used():
    probe = FakeProbe(half={torch.bfloat16: 4.0}, exact={ONEDNN: False, INT_MM: True}, int8={INT_MM: 3.0})
    got = decide(_cpu(ZEN5), probe, AUTO)
    assert got.int8.route == INT_MM
    assert f"int8_speedup {ONEDNN}" not in probe.asked  # an inexact route is not even timed
    nothing_exact = decide(_cpu(ZEN5), FakeProbe(half={torch.bfloat16: 4.0}), AUTO)
    assert nothing_exact.int8.route is None and "no exact int8 GEMM" in nothing_exact.int8.reason
    # Forcing the fast paths never forces an inexact GEMM either.
    assert decide(_cpu(AVX2_ZEN3), FakeProbe(), FORCE).int8.route is None


def test_unreadable_flags_decide_by_measurement_alone():
    facts = _cpu("processor\t: 0\n")  # no flags line (a non-Linux-like cpuinfo)
    assert facts.units == {"bfloat16": None, "float16": None, "int8": None}
    got = decide(facts, FakeProbe(half={torch.bfloat16: 2.0}, exact={INT_MM: True}, int8={INT_MM: 1.0}), AUTO)
    assert got.half[torch.bfloat16].use and "unknown" in got.half[torch.bfloat16].reason
    assert got.int8.route is None


def test_forced_fast_paths_skip_facts_and_timing_but_not_correctness():
    probe = FakeProbe(exact={ONEDNN: False, INT_MM: True})
    got = decide(_cpu(AVX2_ZEN3), probe, FORCE)
    assert got.half[torch.bfloat16].use and got.int8.route == INT_MM
    assert not any(a.startswith(("half_speedup", "int8_speedup")) for a in probe.asked)
    # fp16 products need an fp32-result GEMM even when forced: an fp16 result could overflow.
    assert not got.half[torch.float16].use and "overflow" in got.half[torch.float16].reason
    assert decide(_cpu(AVX2_ZEN3), FakeProbe(fp32_output=True, exact={INT_MM: True}), FORCE).half[torch.float16].use


def test_known_accelerators_are_trusted_without_timing():
    units = {"bfloat16": True, "float16": True, "int8": True}
    facts = DeviceFacts("cuda:0", "NVIDIA H100", units, dict.fromkeys(units, "CUDA 9.0"), measure_speed=False)
    probe = FakeProbe(fp32_output=True, exact={ONEDNN: False, INT_MM: True})
    got = decide(facts, probe, AUTO)
    assert all(c.use and c.fp32_output for c in got.half.values())
    assert got.half[torch.bfloat16].path == "bfloat16 operands, fp32 accumulation, fp32 result"
    assert got.int8.route == INT_MM
    assert not any(a.startswith(("half_speedup", "int8_speedup")) for a in probe.asked)
    # An accelerator type from the GLM-5 table: units known, nothing timed.
    xpu = caps.device_facts(torch.device("xpu"))
    assert xpu.units == units and not xpu.measure_speed
    assert caps.device_facts(torch.device("meta")).measure_speed  # unknown types must measure


def test_a_gemm_that_does_not_run_is_not_used():
    class Failing(FakeProbe):
        def half_speedup(self, dtype: torch.dtype) -> float:
            raise RuntimeError("no bf16 matmul kernel for this device\nmore")

        def int8_speedup(self, route: int8_gemms.Int8Gemm) -> float:
            raise NotImplementedError(f"{route.name} has no kernel here")

    got = decide(_cpu("processor\t: 0\n"), Failing(exact={ONEDNN: True, INT_MM: True}), AUTO)
    bf16 = got.half[torch.bfloat16]
    assert not bf16.use and "does not run here (no bf16 matmul kernel" in bf16.reason
    assert got.int8.route is None and "fails at the probe shape" in got.int8.reason


def test_decide_rejects_the_off_mode():
    with pytest.raises(ValueError, match="mode"):
        decide(_cpu(ZEN5), FakeProbe(), "off")


# ------------------------------------------------------------------------------------------------ facts, mode, cache


@pytest.mark.parametrize(
    ("cpuinfo", "units", "model"),
    [
        (AVX2_ZEN3, {"bfloat16": False, "float16": False, "int8": False}, "AMD EPYC 7B13 (family 25"),
        (ZEN5, {"bfloat16": True, "float16": False, "int8": True}, "AMD EPYC (family 26"),
        (SAPPHIRE_RAPIDS, {"bfloat16": True, "float16": True, "int8": True}, "Intel Xeon"),
        (GRAVITON3, {"bfloat16": True, "float16": True, "int8": True}, "CPU"),
    ],
)
def test_cpu_flags_name_the_units(cpuinfo: str, units: dict, model: str):
    facts = _cpu(cpuinfo)
    assert facts.units == units and facts.description.startswith(model) and facts.measure_speed


def test_mode_from_the_environment_and_the_context_manager(monkeypatch: pytest.MonkeyPatch):
    for value, mode in [("", AUTO), ("auto", AUTO), ("0", caps.OFF), ("off", caps.OFF), ("1", FORCE), ("ON", FORCE)]:
        monkeypatch.setenv(caps.ENV_FAST_PATHS, value)
        assert caps.fast_paths_mode() == mode
    monkeypatch.setenv(caps.ENV_FAST_PATHS, "fast")
    with pytest.raises(ValueError, match="GLM5_HAL_FAST_PATHS: expected auto, 0 .* got 'fast'"):
        caps.fast_paths_mode()
    with caps.fast_paths("0"):  # the context manager wins over the environment, innermost first
        assert caps.fast_paths_mode() == caps.OFF
        with caps.fast_paths("1"):
            assert caps.fast_paths_mode() == FORCE
        assert caps.fast_paths_mode() == caps.OFF


def test_off_probes_nothing_and_auto_is_probed_once_per_process(monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(caps, "DeviceProbe", lambda device: calls.append(device) or FakeProbe())
    monkeypatch.setattr(caps, "device_facts", lambda device: _cpu(AVX2_ZEN3))
    monkeypatch.setattr(caps, "_cache", {})
    off = caps.capabilities("cpu", "0")
    assert calls == [] and off.mode == caps.OFF and off.facts is None
    first = caps.capabilities("cpu", "auto")
    assert caps.capabilities(torch.device("cpu"), "auto") is first and len(calls) == 1
    assert "fast paths auto" in first.describe()[0] and first.as_dict()["int8"]["path"].startswith("chunked fp32")


# ------------------------------------------------------------------------------------------------ int8 routes


def _runnable_routes() -> list[int8_gemms.Int8Gemm]:
    return [r for r in int8_gemms.ROUTES if r.applies(1, 16, 16, torch.device("cpu"))]


@pytest.mark.parametrize("route", _runnable_routes(), ids=lambda r: r.name)
@pytest.mark.parametrize("depth", [16384, 40960])
def test_int8_routes_are_bit_exact_at_large_k_or_never_chosen(route: int8_gemms.Int8Gemm, depth: int):
    cases = int8_gemms.exactness_cases(torch.Generator().manual_seed(depth), depth)
    # The all-extreme rows are past fp32's exact integers, so fp32 accumulation could not pass.
    assert max(float(want.abs().max()) for _, _, want in cases) > 2**24
    ok, why = int8_gemms.is_exact(route, torch.device("cpu"), cases)
    if not ok and "does not run here" in why:
        pytest.skip(f"{route.name} {why}")
    if ok:
        return
    # Not exact on this CPU (oneDNN without VNNI / AMX sums u8 x s8 pairs into saturating int16, AVX2's
    # vpmaddubsw): the probe must find that too and never choose the route, in auto mode or forced.
    assert "accumulators differ" in why, why
    probe = DeviceProbe(torch.device("cpu"))
    assert not probe.int8_exact(route)[0]
    for mode in (AUTO, FORCE):
        chosen = decide(caps.device_facts(torch.device("cpu")), probe, mode)
        assert chosen.int8_route() is not route, (mode, chosen.int8)
        if route is int8_gemms.NATIVE_VNNI:  # nor as the few-rows kernel
            assert chosen.int8.native_rows == 0, (mode, chosen.int8)


def _saturating_pair_sums(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """An int8 GEMM that sums adjacent u8 x s8 products into saturating int16 first, as AVX2's vpmaddubsw does."""
    x_u8 = x_q.to(torch.int64) + 128
    products = x_u8[:, None, :] * w_q.to(torch.int64)[None, :, :]  # [M, N, K]
    pairs = products.view(*products.shape[:2], -1, 2).sum(-1).clamp(-(2**15), 2**15 - 1)
    correction = 128 * w_q.to(torch.int64).sum(-1)  # the zero point, removed exactly
    return (pairs.sum(-1) - correction[None, :]).to(torch.float32)


def test_exactness_check_catches_a_saturating_int8_gemm():
    saturating = int8_gemms.Int8Gemm(
        "saturating", lambda m, k, n, d: True, lambda w: w, _saturating_pair_sums, caches_weights=False
    )
    ok, why = int8_gemms.is_exact(saturating, torch.device("cpu"), int8_gemms.exactness_cases(torch.Generator(), 64))
    assert not ok and "accumulators differ" in why
    never_applies = int8_gemms.Int8Gemm("none", lambda m, k, n, d: False, lambda w: w, lambda x, w: x, False)
    assert int8_gemms.is_exact(never_applies, torch.device("cpu"), int8_gemms.exactness_cases(torch.Generator(), 8))[
        1
    ].startswith("takes none")


# ------------------------------------------------------------------------------------------------ glm5-hal info


def test_info_prints_and_records_the_choice_per_device(capsys, monkeypatch: pytest.MonkeyPatch):
    assert main(["info", "--json"]) == 0
    cpu = report_data(json.loads(capsys.readouterr().out), "torch")["fast_paths"]["cpu"]
    assert cpu["device"] == "cpu" and set(cpu["bfloat16"]) == {"path", "used", "reason"}
    assert cpu["summary"][0].startswith("cpu: fast paths")
    monkeypatch.setenv(caps.ENV_FAST_PATHS, "0")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cpu: fast paths off" in out and "int8 GEMM (W8A8 / W4A8): chunked fp32 GEMMs" in out
    monkeypatch.setenv(caps.ENV_FAST_PATHS, "bogus")
    assert main(["info"]) == 0  # a diagnostic command reports a bad value instead of failing
    assert "cpu: GLM5_HAL_FAST_PATHS: expected auto" in capsys.readouterr().out


def test_the_mode_and_native_settings_apply_to_the_next_call_of_capabilities(monkeypatch: pytest.MonkeyPatch):
    # capabilities(device) remembers its answer per (device, mode setting, native setting): the op-call path.
    monkeypatch.setattr(caps, "DeviceProbe", lambda device: FakeProbe())
    monkeypatch.setattr(caps, "device_facts", lambda device: _cpu(AVX2_ZEN3))
    monkeypatch.setattr(caps, "_cache", {})
    monkeypatch.setattr(caps, "_recent", {})
    monkeypatch.delenv(caps.ENV_FAST_PATHS, raising=False)
    monkeypatch.delenv(build.ENV_NATIVE, raising=False)
    cpu = torch.device("cpu")
    auto = caps.capabilities(cpu)
    assert auto.mode == AUTO and caps.capabilities(cpu) is auto
    monkeypatch.setenv(caps.ENV_FAST_PATHS, "0")
    assert caps.capabilities(cpu).mode == caps.OFF
    with caps.fast_paths("1"):
        assert caps.capabilities(cpu).mode == FORCE
    monkeypatch.setenv(caps.ENV_FAST_PATHS, "nonsense")
    for _ in range(2):
        with pytest.raises(ValueError, match="GLM5_HAL_FAST_PATHS"):
            caps.capabilities(cpu)
    monkeypatch.delenv(caps.ENV_FAST_PATHS)
    assert caps.capabilities(cpu) is auto
    monkeypatch.setenv(build.ENV_NATIVE, "0")  # a separate probe: the native kernels are out of the running
    without_native = caps.capabilities(cpu)
    assert without_native is not auto and ("cpu", AUTO, False) in caps._cache
