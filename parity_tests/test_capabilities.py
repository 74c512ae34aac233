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

import dataclasses
import json
import math

import pytest
import torch

from backends.torch_eager import capabilities as caps
from backends.torch_eager import int8_gemms
from backends.torch_eager.capabilities import AUTO, FORCE, DeviceFacts, DeviceProbe, decide
from backends.torch_eager.gemm import RoutedGemm, from_route
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
    """Measurements on demand, with a record of what was asked (a decision that needs none must ask nothing).

    speed: per route name, its speed over fp32 on every family's workload; times: per (family, rows), per route name,
    seconds that replace those (rows 0 for the families measured at one shape).
    """

    def __init__(
        self,
        speed: dict[str, float] | None = None,
        times: dict[tuple[str, int], dict[str, float]] | None = None,
        fp32_output: bool = False,
        exact: dict[str, bool] | None = None,
        int8: dict[str, float] | None = None,
        residual_exact: bool = True,
        native: tuple[bool, str] = (False, "no native kernel in this fake"),
        streaming_rows: int = 0,
    ) -> None:
        self.speed, self.times = speed or {}, times or {}
        self._fp32_output, self._residual_exact, self._native = fp32_output, residual_exact, native
        self.exact, self.int8 = exact or {}, int8 or {}
        self._streaming_rows = streaming_rows
        self.asked: list[str] = []

    def route_times(self, dtype: torch.dtype, family: str, routes: tuple, rows: int) -> dict[str, float]:
        self.asked.append(f"route_times {dtype} {family} {rows}")
        key = (family, rows) if (family, rows) in self.times else (family, 0)  # 0: the same at every count
        if key in self.times:  # by label where the fake has it (a native route's row prefetch), else by name
            times = {r.label: self.times[key].get(r.label, self.times[key].get(r.name)) for r in routes}
            # The half route's product as an op's output, where the fake has it (the weight family).
            return times | {n: t for n, t in self.times[key].items() if n == f"{caps.HALF} output"}
        return {r.label: 1.0 / self.speed.get(r.name, 1.0) if r.name != caps.FP32 else 1.0 for r in routes}

    def fp32_output(self, dtype: torch.dtype) -> bool:
        self.asked.append(f"fp32_output {dtype}")
        return self._fp32_output

    def native_gemm(self, dtype: torch.dtype, isa: str) -> tuple[bool, str]:
        self.asked.append(f"native_gemm {dtype}")
        # The fake's kernel is the AVX-512 BF16 build; the other builds do not run in it.
        return self._native if isa == "avx512_bf16" else (False, f"no {isa} build in this fake")

    def residual_exact(self, dtype: torch.dtype) -> bool:
        self.asked.append(f"residual_exact {dtype}")
        return self._residual_exact

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


def _all(got: caps.Capabilities, dtype: torch.dtype = torch.bfloat16) -> list[caps.HalfChoice]:
    return list(got.half[dtype].values())


def test_cpu_without_bf16_or_int8_units_keeps_the_conservative_path_and_measures_nothing():
    """No units and no native build that runs: nothing is timed (the native builds are only asked whether they run),
    and the choices are GLM5_HAL_FAST_PATHS=0's."""
    probe = FakeProbe()
    got = decide(_cpu(AVX2_ZEN3), probe, AUTO)
    assert not any(a.startswith(("route_times", "int8_speedup", "residual")) for a in probe.asked), probe.asked
    assert not any(choice.use for dtype in caps.HALF_DTYPES for choice in _all(got, dtype))
    assert got.int8.route is None and got.int8_route() is None
    assert all("no CPU flag avx512_bf16" in c.reason for c in _all(got))
    assert "no int8 dot-product units" in got.int8.reason
    # The same choices as GLM5_HAL_FAST_PATHS=0: the backend runs exactly the conservative code.
    off = caps.capabilities("cpu", "0")
    assert all(not c.use for c in _all(off)) and got.int8.route == off.int8.route is None
    for dtype in caps.HALF_DTYPES:
        assert [(c.small, c.large) for c in _all(got, dtype)] == [(c.small, c.large) for c in _all(off, dtype)]


def test_a_cpu_without_bf16_units_measures_its_native_builds_against_fp32_only():
    """An AVX2 CPU: torch's bf16 GEMM is emulated there (not a candidate, not timed), but a native build that widens
    bf16 to fp32 in registers is, and wins where it measures faster (decode-sized weight products here)."""

    class Avx2Build(FakeProbe):
        def native_gemm(self, dtype: torch.dtype, isa: str) -> tuple[bool, str]:
            self.asked.append(f"native_gemm {dtype} {isa}")
            return (True, "bf16_gemm_avx2") if isa == "avx2" else (False, f"no {isa} here")

    times = {
        (caps.WEIGHTS, caps.DECODE_ROWS): {"fp32": 3.4, "native": 1.1},
        (caps.WEIGHTS, caps.PREFILL_ROWS): {"fp32": 33.0, "native": 50.0},
        (caps.ATTENTION, 0): {"fp32": 5.9, "native": 6.4},
        (caps.INDEXER, 0): {"fp32": 2.3, "native": 1.9},
        (caps.QUANTIZED_INDEXER, 0): {"fp32": 5.1, "native": 1.3},
    }
    probe = Avx2Build(times=times)
    got = decide(_cpu(AVX2_ZEN3), probe, AUTO)
    weights, attention, indexer, quantized = (got.half_choice(torch.bfloat16, f) for f in caps.FAMILIES)
    assert weights.small == caps.replace(weights.small, name="native", isa="avx2") and weights.large.name == "fp32"
    assert not attention.use and indexer.native and indexer.large.isa == "avx2"
    assert quantized.native and quantized.large.isa == "avx2" and "3.92x fp32" in quantized.reason
    assert "residual_exact torch.bfloat16" not in probe.asked  # torch's half GEMM was never a candidate
    assert all(not c.use for c in _all(got, torch.float16))  # the native kernels are bf16 ones
    assert all("no bfloat16 units" in c.reason for c in (weights, attention, indexer, quantized))


def test_a_rounded_result_that_cannot_be_recovered_keeps_the_conservative_path():
    """bf16 GEMMs that return bf16 only, on a device whose addmm rounds before it adds: every intermediate would be
    rounded, so the half route is refused before anything is timed, in every mode (=1 included)."""
    for mode in (AUTO, FORCE):
        probe = FakeProbe(speed={caps.HALF: 4.0}, residual_exact=False)
        for bf16 in _all(decide(_cpu(ZEN5), probe, mode)):
            assert not bf16.use and "addmm rounds before it adds" in bf16.reason
        assert "residual_exact torch.bfloat16" in probe.asked
        assert not any(a.startswith("route_times torch.bfloat16") for a in probe.asked)
    # With an fp32-result GEMM the residual is not needed, and not asked for.
    probe = FakeProbe(speed={caps.HALF: 4.0}, fp32_output=True, residual_exact=False)
    assert all(c.use and c.large.fp32_output for c in _all(decide(_cpu(ZEN5), probe, AUTO)))
    assert "residual_exact torch.bfloat16" not in probe.asked


NATIVE_OK = (True, "bf16_gemm_avx512_bf16, fp32 sums of exact bf16 products")


def test_each_family_takes_its_own_fastest_route():
    """The case issue 29 measured on a Xeon: the native kernel wins the weight products and the indexer, loses
    sparse attention; each family takes what wins on its own workload, with no shared yes / no."""
    times = {
        (caps.WEIGHTS, caps.DECODE_ROWS): {"fp32": 2.0, "half": 3.0, "native": 1.0},
        (caps.WEIGHTS, caps.PREFILL_ROWS): {"fp32": 20.0, "half": 9.0, "native": 10.0},
        (caps.ATTENTION, 0): {"fp32": 15.8, "half": 30.0, "native": 22.2},
        (caps.INDEXER, 0): {"fp32": 4.0, "half": 5.0, "native": 2.0},
        (caps.QUANTIZED_INDEXER, 0): {"fp32": 6.0, "half": 2.0, "native": 3.0},
    }
    probe = FakeProbe(times=times, native=NATIVE_OK)
    got = decide(_cpu(SAPPHIRE_RAPIDS), probe, AUTO)
    weights, attention, indexer, quantized = (got.half_choice(torch.bfloat16, f) for f in caps.FAMILIES)
    # The indexer over quantized rows decides apart from the bf16 rows' (another kernel, decoding first).
    assert quantized.large.name == "half" and "3.00x fp32" in quantized.reason
    assert (weights.small.name, weights.large.name) == ("native", "half") and weights.use
    # Lines through (4, 1.0) and (256, 10.0) for native, (4, 3.0) and (256, 9.0) for half: 1 + 9x = 3 + 6x at
    # x = 2/3 of the span, 4 + 168 = 172 rows.
    assert weights.split_rows == 172 and weights.route(171).name == "native" and weights.route(172).name == "half"
    assert not attention.use and not attention.native and "fp32 fastest" in attention.reason
    assert indexer.small == indexer.large and indexer.native and "2.00x fp32" in indexer.reason
    assert weights.large.max_work == pytest.approx(20.0 / 9.0 / caps.ROUTE_MARGIN)
    assert got.measured[f"bfloat16 attention native:avx512_bf16 {caps.FEW_HEADS} heads (ms)"] == 22200.0
    assert got.half_choice(torch.bfloat16, caps.ATTENTION).path == "fp32 operands"
    # fp32 activations have no choice to make: fp32 stays fp32.
    assert got.half_choice(torch.float32, caps.WEIGHTS) is None


def test_a_route_must_beat_fp32_by_the_margin():
    for speed, used in ((1.04, False), (1.06, True)):
        got = decide(_cpu(ZEN5), FakeProbe(speed={caps.HALF: speed}), AUTO)
        assert all(c.use == used for c in _all(got)), speed
    fast = decide(_cpu(ZEN5), FakeProbe(speed={caps.HALF: 4.0}), AUTO).half_choice(torch.bfloat16)
    assert fast.large.max_work == pytest.approx(4.0 / caps.ROUTE_MARGIN) and "3.8x work" in fast.path


def test_weight_routes_split_where_their_lines_cross():
    """Native at decode, fp32 at prefill (the AVX-512 BF16 kernel against oneDNN's fp32 GEMM): the split comes from
    the two measurements; a route slower at both row counts is never taken."""
    times = {
        (caps.WEIGHTS, caps.DECODE_ROWS): {"fp32": 2.0, "half": 9.0, "native": 1.0},
        (caps.WEIGHTS, caps.PREFILL_ROWS): {"fp32": 10.0, "half": 90.0, "native": 17.0},
    }
    probe = FakeProbe(times=times, native=NATIVE_OK)
    weights = decide(_cpu(SAPPHIRE_RAPIDS), probe, AUTO).half_choice(torch.bfloat16)
    assert (weights.small.name, weights.large.name) == ("native", "fp32")
    # native: 1 + (r - 4) * 16/252, fp32: 2 + (r - 4) * 8/252 -> equal at r = 4 + 252/8 = 35.5
    assert weights.split_rows == 36
    # a: 1 + 2x, b: 2 + 0.5x over the span 4..256: equal at x = 2/3, 4 + 168 rows.
    assert caps._crossing({"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 2.5}, "a", "b", (4, 256)) == 172
    assert caps._crossing({"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 3.0}, "a", "b", (4, 256)) == 256  # parallel


def test_a_native_weight_route_takes_fp32_activations_only_where_their_two_parts_pay():
    """One native route for all rows (the AVX-512 BF16 kernel on a Zen 4, times as its probe measured them): at decode
    an fp32 activation's two parts cost little more than one (the weight is read once), at prefill twice the
    arithmetic, and the native route is only 1.6x fp32 there. So such products take fp32 from the rows of work where
    the doubled rows stop paying; bf16 activations stay native at every row count."""
    times = {
        (caps.WEIGHTS, caps.DECODE_ROWS): {"fp32": 1.7927, "half": 1.08, "half output": 0.5381, "native": 0.2669},
        (caps.WEIGHTS, caps.PREFILL_ROWS): {"fp32": 22.99, "half": 21.05, "half output": 10.5237, "native": 14.1936},
    }
    weights = decide(_cpu(ZEN5), FakeProbe(times=times, native=NATIVE_OK), AUTO).half_choice(torch.bfloat16)
    assert weights.small.label == weights.large.label == "native:avx512_bf16"
    # Lines: fp32 1.4563 + 0.084102 r, native 0.04584 + 0.055265 x; native(x) x 1.05 = fp32(x / 2) at x = 88.1.
    assert weights.split_rows == 89 and "two parts stop paying from 89 rows" in weights.reason
    assert weights.small.max_work == float("inf")
    assert weights.large.max_work == pytest.approx(22.99 / 14.1936 / caps.ROUTE_MARGIN)
    # The op's outputs: native x 1.05 against torch's GEMM of an output (one pass): 0.2802 < 0.5381 at 4 rows,
    # 14.903 > 10.524 at 256; the lines cross at 4 + 0.2578 x 252 / 4.6374 = 18.0 rows.
    assert weights.small.outputs_below == weights.large.outputs_below == 19
    assert "(avx512_bf16 build; the op's outputs too, below 19 rows)" in weights.path
    # Unmeasured (a probe without the output timing), or slower at 4 rows: never; faster at both counts: always.
    for output_times, want in (((None, None), 0.0), ((0.2, 30.0), 0.0), ((0.6, 20.0), math.inf)):
        timed = {key: {n: v for n, v in t.items() if n != "half output"} for key, t in times.items()}
        if output_times[0] is not None:
            timed = {key: {**t, "half output": v} for (key, t), v in zip(timed.items(), output_times)}
        got = decide(_cpu(ZEN5), FakeProbe(times=timed, native=NATIVE_OK), AUTO).half_choice(torch.bfloat16)
        assert got.small.outputs_below == want, output_times
    routed = RoutedGemm(*(from_route(torch.bfloat16, r) for r in (weights.small, weights.large)), weights.split_rows)
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    for rows, dtype, native in ((44, torch.float32, True), (45, torch.float32, False), (4096, torch.bfloat16, True)):
        x = torch.zeros(rows, 16, dtype=dtype)
        assert routed.for_rows(x, rows).takes_half(x, w.T, rows, output=False) == native, (rows, dtype)
    # A native route over twice as fast at prefill too keeps fp32 activations on it at every row count.
    times[(caps.WEIGHTS, caps.PREFILL_ROWS)]["native"] = 9.0
    weights = decide(_cpu(ZEN5), FakeProbe(times=times, native=NATIVE_OK), AUTO).half_choice(torch.bfloat16)
    assert weights.small == weights.large and weights.large.max_work == float("inf")


def test_attention_routes_split_by_head_count():
    """The AVX2 case: the native attention kernel wins at a tensor-parallel share of the heads and loses at all 64
    (times as measured on a Zen 3); a call takes the route for its own head count, and the weight family's row
    split is not involved."""
    times = {
        (caps.ATTENTION, caps.FEW_HEADS): {"fp32": 1.9, "native": 1.45},
        (caps.ATTENTION, caps.ALL_HEADS): {"fp32": 4.8, "native": 7.4},
    }

    class Avx2Build(FakeProbe):
        def native_gemm(self, dtype: torch.dtype, isa: str) -> tuple[bool, str]:
            return (True, "bf16_gemm_avx2") if isa == "avx2" else (False, f"no {isa} here")

    got = decide(_cpu(AVX2_ZEN3), Avx2Build(times=times), AUTO)
    attention = got.half_choice(torch.bfloat16, caps.ATTENTION)
    # (the row prefetch: every hint alike in this fake, so the kernel's default)
    assert (attention.small.label, attention.large.name) == ("native:avx2+l2", "fp32")
    # native: 1.45 + (h - 4) 5.95 / 60, fp32: 1.9 + (h - 4) 2.9 / 60 -> equal at h = 4 + 0.45 * 60 / 3.05 = 12.9
    assert attention.split_rows == 13 and "cross at 13 heads" in attention.reason
    assert "below 13 heads" in attention.path
    assert got.measured[f"bfloat16 attention fp32 {caps.ALL_HEADS} heads (ms)"] == 4800.0
    routed = RoutedGemm(*(from_route(torch.bfloat16, r) for r in (attention.small, attention.large)), 13)
    assert routed.at(12).native_isa == "avx2" and not routed.at(13).half


def test_the_native_attention_route_takes_the_row_prefetch_measured_fastest_from_memory():
    """Which prefetch hint reads scattered rows from memory fastest is the CPU's (head_pairs.h): each native attention
    route is timed with every hint on the from-memory workload at the head count it serves, and keeps the fastest;
    a route that serves every call sums both counts; fp32 is not timed for it. The hint reaches the backend's Gemm."""
    few, many = caps.FEW_HEADS, caps.ALL_HEADS
    split = {
        (caps.ATTENTION, few): {"fp32": 1.9, "native": 1.45},
        (caps.ATTENTION, many): {"fp32": 4.8, "native": 7.4},
        # times of the order of a Zen 5's at 4 heads (a fake's, ms; measured 0.527 / 0.340 / 0.345): L2 the slowest
        (caps.ATTENTION_FROM_MEMORY, few): {"native:avx2+l2": 0.58, "native:avx2+l1": 0.40, "native:avx2+nta": 0.39},
    }

    class Avx2Build(FakeProbe):
        def native_gemm(self, dtype: torch.dtype, isa: str) -> tuple[bool, str]:
            return (True, "bf16_gemm_avx2") if isa == "avx2" else (False, f"no {isa} here")

    probe = Avx2Build(times=split)
    got = decide(_cpu(AVX2_ZEN3), probe, AUTO)
    attention = got.half_choice(torch.bfloat16, caps.ATTENTION)
    assert attention.small.label == "native:avx2+nta" and attention.large == caps.FP32_ROUTE
    assert f"route_times torch.bfloat16 {caps.ATTENTION_FROM_MEMORY} {few}" in probe.asked
    assert f"route_times torch.bfloat16 {caps.ATTENTION_FROM_MEMORY} {many}" not in probe.asked
    assert "native:avx2 rows non-temporally (1.49x the default from memory)" in attention.reason
    assert "rows prefetched non-temporally" in attention.path
    assert got.measured[f"bfloat16 attention native:avx2+l1 {few} heads, rows from memory (ms)"] == 400.0
    assert from_route(torch.bfloat16, attention.small).row_prefetch == "nta"
    # One native route for every head count: the hint with the least time over both counts (l1 wins at few heads
    # by less than l2 wins at many).
    one_route = {
        (caps.ATTENTION, 0): {"fp32": 4.0, "native": 1.0},
        (caps.ATTENTION_FROM_MEMORY, few): {"native:avx2+l2": 0.50, "native:avx2+l1": 0.45, "native:avx2+nta": 0.47},
        (caps.ATTENTION_FROM_MEMORY, many): {"native:avx2+l2": 1.00, "native:avx2+l1": 1.20, "native:avx2+nta": 1.10},
    }
    attention = decide(_cpu(AVX2_ZEN3), Avx2Build(times=one_route), AUTO).half_choice(torch.bfloat16, caps.ATTENTION)
    assert attention.small == attention.large and attention.large.prefetch == "l2"
    # Forcing the fast paths times nothing: the kernel's default hint.
    forced = decide(_cpu(AVX2_ZEN3), Avx2Build(times=split), FORCE).half_choice(torch.bfloat16, caps.ATTENTION)
    assert forced.large.prefetch == "" and from_route(torch.bfloat16, forced.large).row_prefetch == ""


def test_the_native_quantized_indexer_route_takes_the_row_prefetch_measured_fastest_from_memory():
    """The quantized indexer's scorer prefetches the next chunk's rows too, and which hint is fastest from memory is
    the CPU's (quantized_index_scores.c: on a Zen 5 into L2 took 1.2-1.34x the others' time): its native route is
    timed with every hint on its own from-memory workload at FEW_HEADS heads (where every build prefetches) and keeps
    the fastest; a tie keeps the kernel's default (non-temporal), not the first of ROW_PREFETCHES."""
    few = caps.FEW_HEADS
    label = "native:avx512_bf16"
    zen5_like = {
        (caps.QUANTIZED_INDEXER_FROM_MEMORY, few): {f"{label}+nta": 0.35, f"{label}+l1": 0.34, f"{label}+l2": 0.41}
    }
    probe = FakeProbe(speed={caps.NATIVE: 2.0, caps.HALF: 0.5}, times=zen5_like, native=NATIVE_OK)
    got = decide(_cpu(ZEN5), probe, AUTO)
    indexer = got.half_choice(torch.bfloat16, caps.QUANTIZED_INDEXER)
    assert indexer.small == indexer.large and indexer.large.label == f"{label}+l1"
    assert f"route_times torch.bfloat16 {caps.QUANTIZED_INDEXER_FROM_MEMORY} {few}" in probe.asked
    assert not any(f"{caps.QUANTIZED_INDEXER_FROM_MEMORY} {caps.ALL_HEADS}" in asked for asked in probe.asked)
    assert f"{label} rows into L1 (1.03x the default from memory)" in indexer.reason
    assert got.measured[f"bfloat16 quantized_indexer {label}+l2 {few} heads, rows from memory (ms)"] == 410.0
    assert from_route(torch.bfloat16, indexer.large).row_prefetch == "l1"
    # The other families keep no hint (the bf16-row indexer's kernel takes none); attention gets its own.
    assert got.half_choice(torch.bfloat16, caps.INDEXER).large.prefetch == ""
    tie = {(caps.QUANTIZED_INDEXER_FROM_MEMORY, few): dict.fromkeys((f"{label}+{h}" for h in ("nta", "l1", "l2")), 0.4)}
    probe = FakeProbe(speed={caps.NATIVE: 2.0, caps.HALF: 0.5}, times=tie, native=NATIVE_OK)
    indexer = decide(_cpu(ZEN5), probe, AUTO).half_choice(torch.bfloat16, caps.QUANTIZED_INDEXER)
    assert indexer.large.prefetch == "nta" and "rows non-temporally (1.00x the default" in indexer.reason
    # Forcing the fast paths times nothing: the kernel's default hint.
    forced = decide(_cpu(ZEN5), FakeProbe(native=NATIVE_OK), FORCE).half_choice(torch.bfloat16, caps.QUANTIZED_INDEXER)
    assert forced.large.prefetch == "" and from_route(torch.bfloat16, forced.large).row_prefetch == ""


def test_a_native_kernel_that_is_slow_or_missing_is_not_used():
    slow = decide(_cpu(ZEN5), FakeProbe(speed={caps.NATIVE: 1.02, caps.HALF: 0.5}, native=NATIVE_OK), AUTO)
    assert all(not c.use and not c.native for c in _all(slow))
    why = "bf16_gemm_avx512_bf16 needs CPU flags avx512_bf16, which this CPU does not list"
    missing = decide(_cpu(ZEN5), FakeProbe(speed={caps.HALF: 4.0}, native=(False, why)), AUTO)
    for bf16 in _all(missing):
        assert bf16.use and not bf16.native and not bf16.large.fp32_output and why in bf16.reason
    # A GEMM that hands back fp32 itself (CUDA's out_dtype) needs no native kernel: it is not even asked.
    probe = FakeProbe(speed={caps.HALF: 4.0, caps.NATIVE: 8.0}, fp32_output=True, native=NATIVE_OK)
    assert not any(c.native for c in _all(decide(_cpu(ZEN5), probe, AUTO)))
    assert "native_gemm torch.bfloat16" not in probe.asked


def test_glm5_hal_native_0_turns_the_native_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The escape hatch for the native kernels: the real probe reports it as the reason, and the per-process cache
    answers per setting (a choice made with the kernel on is not reused with it off)."""
    monkeypatch.setenv("GLM5_HAL_NATIVE", "0")
    ok, why = DeviceProbe(torch.device("cpu")).native_gemm(torch.bfloat16, "avx512_bf16")
    assert not ok and why == "GLM5_HAL_NATIVE=0"
    off = caps.capabilities("cpu", FORCE).half_choice(torch.bfloat16)
    assert not off.native and "GLM5_HAL_NATIVE=0" in off.reason
    monkeypatch.delenv("GLM5_HAL_NATIVE")
    on = caps.capabilities("cpu", FORCE).half_choice(torch.bfloat16)
    runs = [DeviceProbe(torch.device("cpu")).native_gemm(torch.bfloat16, isa)[0] for isa in caps.native_isas()]
    assert on.native == any(runs)


def test_the_real_probe_sees_this_cpus_addmm_add_in_fp32_or_refuses() -> None:
    """DeviceProbe.residual_exact on this machine agrees with a direct measurement of the recovered product."""
    probe = DeviceProbe(torch.device("cpu"))
    a, b = torch.randn(8, 512).bfloat16(), torch.randn(512, 32).bfloat16()
    rounded = a @ b
    recovered = rounded.double() + torch.addmm(rounded, a, b, beta=-1).double()
    want = a.double() @ b.double()
    measured = bool((recovered - want).abs().amax() <= 2.0**-13 * want.abs().amax())
    assert probe.residual_exact(torch.bfloat16) == measured


def test_the_real_route_timer_runs_every_family_on_every_route() -> None:
    """route_workloads on this CPU: each family's workload runs on each correct route and gives a positive time (the
    speeds are not asserted: they are this machine's)."""
    probe = DeviceProbe(torch.device("cpu"))
    routes, _ = caps._correct_routes(torch.bfloat16, probe)
    assert routes[0] == caps.FP32_ROUTE and len(routes) >= 2  # fp32 and at least the residual route here
    for family in caps.FAMILIES:
        got = probe.route_times(torch.bfloat16, family, tuple(routes), caps.DECODE_ROWS)
        want = {r.label for r in routes}
        if family == caps.WEIGHTS:  # and the half route's product as an op's output (one pass)
            want |= {caps.output_label(r) for r in routes if r.name == caps.HALF}
        assert set(got) == want and all(0 < t < 10 for t in got.values()), (family, got)
    # The row-prefetch workloads, on each native route with each hint (from memory: the median of the calls).
    native = [r for r in routes if r.name == caps.NATIVE]
    for family, workload in caps.FROM_MEMORY.items():
        hinted = tuple(dataclasses.replace(r, prefetch=h) for r in native for h in caps.ROW_PREFETCHES)
        got = probe.route_times(torch.bfloat16, workload, hinted, caps.PREFETCH_COUNTS[family][0])
        assert set(got) == {r.label for r in hinted} and all(0 < t < 10 for t in got.values()), (family, got)


def test_cpu_with_units_and_a_measured_win_takes_the_fast_paths():
    probe = FakeProbe(speed={caps.HALF: 4.0}, exact={ONEDNN: True, INT_MM: True}, int8={ONEDNN: 6.0, INT_MM: 7.0})
    got = decide(_cpu(ZEN5), probe, AUTO)
    for bf16 in _all(got):
        assert bf16.use and not bf16.large.fp32_output and "rounding residual" in bf16.path
        assert "avx512_bf16" in bf16.reason and "4.00x" in bf16.reason
    assert all(not c.use and "no CPU flag avx512_fp16" in c.reason for c in _all(got, torch.float16))
    # Routes are taken in order of preference among the exact ones that win, not by the probe shape's speed alone.
    assert got.int8.route == ONEDNN and got.int8_route() is int8_gemms.ONEDNN_U8S8
    assert got.measured[f"{ONEDNN} (int8)"] == 6.0 and "bfloat16 weights half 256 rows (ms)" in got.measured


def test_cpu_flags_without_a_measured_win_keep_the_conservative_path():
    probe = FakeProbe(speed={caps.HALF: 0.9}, exact={ONEDNN: True, INT_MM: True}, int8={ONEDNN: 1.1, INT_MM: 0.2})
    got = decide(_cpu(ZEN5), probe, AUTO)
    assert all(not c.use and "fp32 fastest" in c.reason for c in _all(got))
    assert got.int8.route is None and ">= 1.25x" in got.int8.reason


def test_the_native_int8_kernel_takes_the_row_counts_it_measured_faster_for():
    exact = {ONEDNN: True, NATIVE_INT8: True, INT_MM: True}
    probe = FakeProbe(exact=exact, int8={ONEDNN: 6.0}, streaming_rows=4)
    got = decide(_cpu(ZEN5), probe, AUTO).int8
    assert got.route == ONEDNN and got.native_rows == 4
    assert [got.takes_native(rows) for rows in (0, 1, 4, 5, 64)] == [False, True, True, False, False]
    assert f"{NATIVE_INT8} up to 4 rows" in got.path and "up to 4 rows (weight from memory)" in got.native_reason
    assert f"int8_streaming_rows {NATIVE_INT8} vs {ONEDNN}" in probe.asked
    # Slower at one row already: never used, and the reason says so.
    slower = decide(_cpu(ZEN5), FakeProbe(exact=exact, int8={ONEDNN: 6.0}), AUTO).int8
    assert slower.native_rows == 0 and not slower.takes_native(1) and "slower" in slower.native_reason
    # Not exact (or not built here): not measured, not used.
    inexact = FakeProbe(exact={ONEDNN: True}, int8={ONEDNN: 6.0}, streaming_rows=4)
    got = decide(_cpu(ZEN5), inexact, AUTO).int8
    assert got.native_rows == 0 and not any("streaming" in asked for asked in inexact.asked)
    # Forced fast paths measure nothing and run glm5-hal's own kernel at every row count (issue 29: forcing left the
    # cut-off at 0, so it never ran the native kernel); where it is not exact, the first exact route.
    forced = decide(_cpu(ZEN5), FakeProbe(exact=exact, streaming_rows=4), FORCE).int8
    assert forced.route == NATIVE_INT8 and forced.takes_native(1) and forced.takes_native(4096)
    assert decide(_cpu(ZEN5), FakeProbe(exact={**exact, NATIVE_INT8: False}), FORCE).int8.route == ONEDNN


def test_the_native_int8_kernel_as_the_general_route_takes_every_row_count():
    probe = FakeProbe(exact={NATIVE_INT8: True}, int8={NATIVE_INT8: 5.0})
    got = decide(_cpu(ZEN5), probe, AUTO).int8
    assert got.route == NATIVE_INT8 and got.takes_native(1) and got.takes_native(4096)
    assert not any("streaming" in asked for asked in probe.asked)


def test_an_inexact_int8_route_is_never_used():
    probe = FakeProbe(exact={ONEDNN: False, INT_MM: True}, int8={INT_MM: 3.0})
    got = decide(_cpu(ZEN5), probe, AUTO)
    assert got.int8.route == INT_MM
    assert f"int8_speedup {ONEDNN}" not in probe.asked  # an inexact route is not even timed
    nothing_exact = decide(_cpu(ZEN5), FakeProbe(), AUTO)
    assert nothing_exact.int8.route is None and "no exact int8 GEMM" in nothing_exact.int8.reason
    # Forcing the fast paths never forces an inexact GEMM either.
    assert decide(_cpu(AVX2_ZEN3), FakeProbe(), FORCE).int8.route is None


def test_unreadable_flags_decide_by_measurement_alone():
    facts = _cpu("processor\t: 0\n")  # no flags line (a non-Linux-like cpuinfo)
    assert facts.units == {"bfloat16": None, "float16": None, "int8": None}
    got = decide(facts, FakeProbe(speed={caps.HALF: 2.0}, exact={INT_MM: True}, int8={INT_MM: 1.0}), AUTO)
    assert all(c.use and "unknown" in c.reason for c in _all(got))
    assert got.int8.route is None


def test_forced_fast_paths_skip_facts_and_timing_but_not_correctness():
    probe = FakeProbe(exact={ONEDNN: False, INT_MM: True}, native=NATIVE_OK)
    got = decide(_cpu(AVX2_ZEN3), probe, FORCE)
    assert all(c.use and c.native for c in _all(got)) and got.int8.route == INT_MM
    assert not any(a.startswith(("route_times", "int8_speedup")) for a in probe.asked)
    # Without the native kernel, the residual route everywhere.
    assert all(c.small.name == caps.HALF for c in _all(decide(_cpu(AVX2_ZEN3), FakeProbe(), FORCE)))
    # fp16 products need an fp32-result GEMM even when forced: an fp16 result could overflow.
    assert all(not c.use and "overflow" in c.reason for c in _all(got, torch.float16))
    fp32_result = decide(_cpu(AVX2_ZEN3), FakeProbe(fp32_output=True, exact={INT_MM: True}), FORCE)
    assert all(c.use for c in _all(fp32_result, torch.float16))


def test_known_accelerators_are_trusted_without_timing():
    units = {"bfloat16": True, "float16": True, "int8": True}
    facts = DeviceFacts("cuda:0", "NVIDIA H100", units, dict.fromkeys(units, "CUDA 9.0"), measure_speed=False)
    probe = FakeProbe(fp32_output=True, exact={ONEDNN: False, INT_MM: True})
    got = decide(facts, probe, AUTO)
    assert all(c.use and c.large.fp32_output for dtype in caps.HALF_DTYPES for c in _all(got, dtype))
    assert got.half_choice(torch.bfloat16).path == "bfloat16 operands, fp32 result"
    assert got.int8.route == INT_MM
    assert not any(a.startswith(("route_times", "int8_speedup")) for a in probe.asked)
    # An accelerator type from the GLM-5 table: units known, nothing timed.
    xpu = caps.device_facts(torch.device("xpu"))
    assert xpu.units == units and not xpu.measure_speed
    assert caps.device_facts(torch.device("meta")).measure_speed  # unknown types must measure


def test_a_gemm_that_does_not_run_is_not_used():
    class Failing(FakeProbe):
        def route_times(self, dtype: torch.dtype, family: str, routes: tuple, rows: int) -> dict[str, float]:
            raise RuntimeError("no bf16 matmul kernel for this device\nmore")

        def int8_speedup(self, route: int8_gemms.Int8Gemm) -> float:
            raise NotImplementedError(f"{route.name} has no kernel here")

    got = decide(_cpu("processor\t: 0\n"), Failing(exact={ONEDNN: True, INT_MM: True}), AUTO)
    assert all(not c.use and "do not run here (no bf16 matmul kernel" in c.reason for c in _all(got))
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


def test_off_probes_nothing_and_auto_is_probed_once_per_process(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path))  # an empty probe store: the fake's answer stays there
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
    assert cpu["device"] == "cpu" and set(cpu["bfloat16"]) == set(caps.FAMILIES)
    assert set(cpu["bfloat16"]["attention"]) == {"path", "used", "reason", "ops"}
    assert cpu["summary"][0].startswith("cpu: fast paths")
    monkeypatch.setenv(caps.ENV_FAST_PATHS, "0")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cpu: fast paths off" in out and "int8 GEMM (W8A8 / W4A8): chunked fp32 GEMMs" in out
    monkeypatch.setenv(caps.ENV_FAST_PATHS, "bogus")
    assert main(["info"]) == 0  # a diagnostic command reports a bad value instead of failing
    assert "cpu: GLM5_HAL_FAST_PATHS: expected auto" in capsys.readouterr().out


def test_the_mode_and_native_settings_apply_to_the_next_call_of_capabilities(monkeypatch: pytest.MonkeyPatch, tmp_path):
    # capabilities(device) remembers its answer per (device, mode setting, native setting): the op-call path.
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path))  # an empty probe store: the fake's answers stay there
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
    assert without_native is not auto and ("cpu", AUTO, build.OFF) in caps._cache
