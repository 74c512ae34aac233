"""Which GEMM route each op family of the torch backend takes on a device, and why: the capability probe.

Per device and mode, answered from known device facts and, where facts are not enough, measurements on the device
(once per machine: the answer is kept on disk by probe_store.py, and in memory per process):

- half-precision products (bf16, fp16): per op family (FAMILIES: the weight products of the prologs and experts,
  sparse attention, the indexer over bf16 keys, the indexer over quantized index rows), the fastest route that is
  correct here, timed on the family's own workload
  (route_workloads.py). The routes: fp32 operands; torch's GEMM with half-precision operands and fp32 accumulation
  (its fp32 result by out_dtype, else its rounded result plus a residual GEMM that recovers the rounding, where the
  probe finds that the GEMM adds in fp32 before it rounds: backends/torch_eager/gemm.py); and the native kernels'
  fp32 result, one route per build that runs here and is exact (NATIVE_ISAS: AMX, AVX-512 BF16, AVX2). fp16 needs
  an fp32 result (an fp16 one could overflow where fp32 does not). The weight family is timed at a decode and a
  prefill row count, sparse attention at two head counts (MEASURED_COUNTS), and their products or calls switch route
  where the lines through the two cross. The native kernels of sparse attention and of the indexer over quantized rows
  also get the prefetch hint for the rows they read next that measured fastest here with the rows coming from memory
  (`_with_row_prefetch`: the best hint is the CPU's, not the code's).
- an exact int8 GEMM (int8 x int8 -> int32, backends.torch_eager.int8_gemms): which route runs here, is it bit-exact at
  large K with extreme codes, and is it faster than the fp32 GEMM? Otherwise the quantized ops keep their exact
  chunked-fp32 path.

Facts: the accelerator types the project targets (CUDA, NPU, MLU, MUSA, GCU; and Intel XPU) have bf16 / fp16 /
int8 units (CUDA: by compute capability) and take their half-precision route untimed; a CPU has them when its ISA
flags say so (x86 avx512_bf16 / amx_bf16, avx512_fp16 / amx_fp16, avx512_vnni / avx_vnni / amx_int8; Arm bf16,
asimdhp, asimddp / i8mm). On a CPU whose flags lack a unit torch's GEMM for it is emulated and never a candidate;
only the native builds (which widen bf16 to fp32 in registers) are timed against fp32 there, and without one the
CPU runs the same code as with GLM5_HAL_FAST_PATHS=0.

`GLM5_HAL_FAST_PATHS` overrides the choice: `auto` (default) as above; `0` the conservative fp32 path everywhere
(for bisecting numerics: the arithmetic the backends did before they had fast paths); `1` every family on the first
correct fast route (a native build, else torch's half GEMM), whatever its speed (exactness and the fp16 rule still
apply; for testing the fast paths on machines where they are slow).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from backends.torch_eager import int8_gemms, probe_store
from backends.torch_eager.native import amx_gemm, bf16_gemm, build
from backends.torch_eager.native import quantized_index_scores as native_quantized_scores
from backends.torch_eager.native import sparse_attention as native_attention
from backends.torch_eager.native.row_prefetch import ROW_PREFETCHES
from glm5_hal.checks import check
from glm5_hal.cpu_flags import cache_flush_bytes, parse_cpuinfo, this_cpu
from glm5_hal.environment import parsed_setting, raw_setting

ENV_FAST_PATHS = "GLM5_HAL_FAST_PATHS"
AUTO, OFF, FORCE = "auto", "off", "force"
_MODE_SPELLINGS = {"": AUTO, "auto": AUTO, "0": OFF, "off": OFF, "false": OFF, "1": FORCE, "on": FORCE, "force": FORCE}

HALF_DTYPES = (torch.bfloat16, torch.float16)
# A route other than fp32 must beat the fp32 one by this much where it was measured: a margin over timing noise, and
# small enough that `auto` stays within 10% of the fastest route (issue 29's goal).
ROUTE_MARGIN = 1.05
# The int8 routes keep their older, wider margin (their measured ratios are far from 1 either way).
MIN_SPEEDUP = 1.25
PROBE_SHAPE = (64, 1024, 1024)  # the int8 routes' probe GEMM: M tokens x K x N
PROBE_REPS = 5
# The op families whose products take one route each (per activation dtype), measured on their own workloads
# (route_workloads.py): the weight products of the prologs and experts, measured at a decode and a prefill row count
# (a line through the two gives the row count where two routes cross); sparse attention's and the indexer's
# batched products over gathered rows, measured at a decode-sized call each. The indexer over quantized index rows
# (fp8_index, int8_index: the rows vLLM stores) is a family of its own: its rows are decoded before any product, and
# its native kernel (native/quantized_index_scores.c) is another kernel than the bf16 rows' one.
WEIGHTS, ATTENTION, INDEXER, QUANTIZED_INDEXER = "weights", "attention", "indexer", "quantized_indexer"
FAMILIES = (WEIGHTS, ATTENTION, INDEXER, QUANTIZED_INDEXER)
FAMILY_OPS = {
    WEIGHTS: "mla_prolog, indexer_prolog, grouped_matmul, fused_moe",
    ATTENTION: "sparse_flash_attention",
    INDEXER: "indexer_logits, lightning_indexer",
    QUANTIZED_INDEXER: "indexer_logits, lightning_indexer over fp8_index / int8_index keys",
}
DECODE_ROWS, PREFILL_ROWS = 4, 256  # the weight family's two measured row counts
# Sparse attention's two measured head counts: a 16-way tensor-parallel share of GLM-5's 64 heads (glm5-mini's 4, the
# vLLM plugin's), and all 64. A kernel that reads each selected row once for every head wins at few heads, torch's
# GEMM over gathered rows at many (this probe on an AVX2 Zen 3, docs/perf.md: native:avx2 2.5x faster than fp32 at 8
# heads, 1.4x slower at 64). Few is 4, not 8: at most 4 heads the AVX2 build reads the rows once (its one-pass route),
# which a line through 8 heads cannot see (on a Zen 5 it took half the AVX-512 build's time at 4 heads and 1.1x its
# time at 8, so the probe measured at 8 sent 4-head calls to the slower build).
FEW_HEADS, ALL_HEADS = 4, 64
# The two counts a family is measured at (a line through its times at both gives the count where two routes cross;
# each product, or each call, then takes the route for its own count), and what the count counts. The other families
# are measured at one decode-sized call.
MEASURED_COUNTS: dict[str, tuple[int, int]] = {WEIGHTS: (DECODE_ROWS, PREFILL_ROWS), ATTENTION: (FEW_HEADS, ALL_HEADS)}
COUNT_UNITS: dict[str, str] = {WEIGHTS: "rows", ATTENTION: "heads"}
# The workloads route_times runs to choose a native kernel's row prefetch (_with_row_prefetch), per family: its call
# at one decode token over a long context, the last-level cache overwritten before each call, so that the rows it
# reads come from memory as at a long context's decode step (where the hint matters: in cache every hint took about
# the same time), at the head counts of PREFETCH_COUNTS. The quantized indexer's is timed at few heads only: there
# every build's scorer prefetches (the AVX2 build's only at <= 4 heads), and on a Zen 5 the hints' order was the same
# at 32 heads (quantized_index_scores.c).
ATTENTION_FROM_MEMORY = "attention_from_memory"
QUANTIZED_INDEXER_FROM_MEMORY = "quantized_indexer_from_memory"
FROM_MEMORY: dict[str, str] = {ATTENTION: ATTENTION_FROM_MEMORY, QUANTIZED_INDEXER: QUANTIZED_INDEXER_FROM_MEMORY}
PREFETCH_COUNTS: dict[str, tuple[int, ...]] = {ATTENTION: (FEW_HEADS, ALL_HEADS), QUANTIZED_INDEXER: (FEW_HEADS,)}
# Each kernel's hint where nothing measured it: tried first, and kept on a tie.
DEFAULT_PREFETCHES: dict[str, str] = {
    ATTENTION: native_attention.DEFAULT_PREFETCH,
    QUANTIZED_INDEXER: native_quantized_scores.DEFAULT_PREFETCH,
}
PREFETCH_WORDS = {"l2": "into L2", "l1": "into L1", "nta": "non-temporally"}
# The routes: fp32 operands; torch's GEMM with half-precision operands (fp32 result by out_dtype, else rounded plus
# the residual GEMM: backends/torch_eager/gemm.py); the native kernel's fp32 result (CPU bf16).
FP32, HALF, NATIVE = "fp32", "half", "native"
# The native bf16 kernels' builds a NATIVE route may run (native/build.py ISAS), fastest first: each that builds here
# and is exact is a route of its own, measured like the others (=1 forces the first). Under GLM5_HAL_NATIVE=portable
# every build is the portable one, so there is one route.
NATIVE_ISAS = ("amx", "avx512_bf16", "avx2")
# Row counts tried for where glm5-hal's native int8 GEMM (the weight in its panels) beats the general int8 route on a
# product whose weight comes from memory (decode, and the short prefill chunks of speculative or batched decode), and
# that weight [N, K] (8 MiB of int8). Past the last count the general route runs (its threading is the library's).
STREAMING_ROWS = (1, 2, 4, 8, 16, 32, 64)
STREAMING_WEIGHT = (2048, 4096)
# Depth of the int8 exactness check: GLM-5's widest projection (o_proj, K = 16384).
EXACTNESS_DEPTH = 16384
# What a GEMM that does not exist on a device (or in this torch) raises.
RUNTIME_ERRORS = (RuntimeError, NotImplementedError, TypeError, AttributeError)

# Accelerator device types with bf16 / fp16 / int8 matrix units: the project's targets (issue 12 names NPU, MLU,
# MUSA, GCU and CUDA, handled by compute capability below) and Intel XPU.
ACCELERATOR_UNITS: dict[str, str] = {
    "npu": "Ascend NPU (Cube unit: fp16 / bf16 / int8)",
    "mlu": "Cambricon MLU (bf16 / fp16 / int8)",
    "musa": "Moore Threads MUSA GPU (tensor cores)",
    "gcu": "Enflame GCU (bf16 / fp16 / int8)",
    "xpu": "Intel XPU (XMX engines)",
}
# CPU ISA flags (Linux /proc/cpuinfo: x86 `flags`, Arm `Features`) that mean a unit exists.
CPU_UNIT_FLAGS: dict[str, tuple[str, ...]] = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),
    "float16": ("avx512_fp16", "amx_fp16", "asimdhp"),
    "int8": ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm"),
}
UNITS = tuple(CPU_UNIT_FLAGS)  # "bfloat16", "float16", "int8"


def _unit(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------ the mode


_override: list[str] = []  # innermost `fast_paths(...)` first


def parse_mode(value: str) -> str:
    """AUTO, OFF or FORCE from a GLM5_HAL_FAST_PATHS spelling; a ValueError names the accepted ones."""
    mode = _MODE_SPELLINGS.get(value.strip().lower())
    check(
        mode is not None,
        ValueError,
        lambda: (
            f"{ENV_FAST_PATHS}: expected auto, 0 (conservative fp32 paths) or 1 (every correct fast path), "
            f"got {value!r}"
        ),
    )
    return mode


def fast_paths_mode() -> str:
    """The mode in force: the innermost `fast_paths(...)` block, else GLM5_HAL_FAST_PATHS, else AUTO."""
    return _override[-1] if _override else parsed_setting(ENV_FAST_PATHS, parse_mode)


@contextlib.contextmanager
def fast_paths(mode: str) -> Iterator[None]:
    """Run a block with the fast paths in `mode` (a GLM5_HAL_FAST_PATHS spelling), whatever the environment says;
    `glm5-hal bench --fast-paths auto,0` times both sides in one run this way."""
    _override.append(parse_mode(mode))
    try:
        yield
    finally:
        _override.pop()


# ------------------------------------------------------------------------------------------------ facts


@dataclass(frozen=True)
class DeviceFacts:
    """What is known about a device without running anything on it.

    units: per unit ("bfloat16", "float16", "int8"): True (it has one), False (it has none), None (unknown).
    evidence: per unit, where that comes from (the CPU flags found or missed, the compute capability, ...).
    measure_speed: whether a fast path also needs a measured win here (CPUs and unknown device types; the
    accelerator types GLM-5 targets are trusted).
    """

    device: str
    description: str
    units: dict[str, bool | None]
    evidence: dict[str, str]
    measure_speed: bool


def cpu_facts(cpuinfo: str | None = None) -> DeviceFacts:
    """Facts of the CPU from its ISA flags (`cpuinfo`: the text of /proc/cpuinfo; read when None)."""
    model, flags = this_cpu() if cpuinfo is None else parse_cpuinfo(cpuinfo)
    description = f"{model}, {torch.get_num_threads()} torch threads, ATen {_cpu_capability()} kernels"
    if flags is None:
        return DeviceFacts("cpu", description, dict.fromkeys(UNITS), dict.fromkeys(UNITS, "no CPU flags here"), True)
    units: dict[str, bool | None] = {}
    evidence = {}
    for unit, names in CPU_UNIT_FLAGS.items():
        found = [f for f in names if f in flags]
        units[unit] = bool(found)
        evidence[unit] = f"CPU flag {', '.join(found)}" if found else f"no CPU flag {' / '.join(names)}"
    return DeviceFacts("cpu", description, units, evidence, True)


def _cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def cuda_facts(device: torch.device) -> DeviceFacts:
    """Facts of a CUDA (or ROCm) GPU from its compute capability: bf16 from sm_80 (or ROCm's own answer), fp16
    tensor cores from sm_70, int8 tensor cores from sm_75."""
    name = torch.cuda.get_device_name(device)
    if torch.version.hip:
        bf16 = torch.cuda.is_bf16_supported()
        units = {"bfloat16": bf16, "float16": True, "int8": True}
        return DeviceFacts(str(device), f"{name} (ROCm)", units, dict.fromkeys(UNITS, "ROCm GPU"), False)
    major, minor = torch.cuda.get_device_capability(device)
    cc = (major, minor)
    units = {"bfloat16": cc >= (8, 0), "float16": cc >= (7, 0), "int8": cc >= (7, 5)}
    evidence = dict.fromkeys(UNITS, f"CUDA compute capability {major}.{minor}")
    return DeviceFacts(str(device), name, units, evidence, False)


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts for any torch device: CPU flags, CUDA capability, the GLM-5 accelerator table, else unknown."""
    if device.type == "cpu":
        return cpu_facts()
    if device.type == "cuda":
        return cuda_facts(device)
    if device.type in ACCELERATOR_UNITS:
        evidence = dict.fromkeys(UNITS, f"{device.type} device")
        return DeviceFacts(str(device), ACCELERATOR_UNITS[device.type], dict.fromkeys(UNITS, True), evidence, False)
    unknown = dict.fromkeys(UNITS, "unknown device type")
    return DeviceFacts(str(device), device.type, dict.fromkeys(UNITS), unknown, True)


# ------------------------------------------------------------------------------------------------ measurements


class Probe(Protocol):
    """What the decision may measure on the device (faked in the unit tests)."""

    def route_times(self, dtype: torch.dtype, family: str, routes: tuple[Route, ...], rows: int) -> dict[str, float]:
        """Per route (by Route.label): the best (from memory: the median) time of `family`'s workload (of FAMILIES,
        or a FROM_MEMORY one) with `dtype` activations on that route, the routes timed alternately
        (route_workloads.py); `rows`: the weight family's row count, or the heads of sparse attention and of the
        from-memory workloads (the others ignore it)."""

    def fp32_output(self, dtype: torch.dtype) -> bool:
        """Whether a GEMM of `dtype` operands can hand back fp32 (torch.mm(..., out_dtype=torch.float32))."""

    def native_gemm(self, dtype: torch.dtype, isa: str) -> tuple[bool, str]:
        """Whether backends.torch_eager.native's `dtype` x `dtype` -> fp32 GEMM built for `isa` runs here and is exact
        (fp32 sums of the exact products), and what runs or why not: the fp32 result torch's own GEMM lacks on CPUs."""

    def residual_exact(self, dtype: torch.dtype) -> bool:
        """Whether addmm / baddbmm with `dtype` operands add their input matrix to the fp32 accumulator before they
        round, so that r + addmm(r, a, b, beta=-1), r = a @ b rounded, recovers the fp32 product (gemm.py).
        """

    def int8_exact(self, route: int8_gemms.Int8Gemm) -> tuple[bool, str]:
        """Whether the route runs and is bit-exact here (int8_gemms.is_exact at EXACTNESS_DEPTH), and why."""

    def int8_speedup(self, route: int8_gemms.Int8Gemm) -> float:
        """Time of the fp32 GEMM / time of the route's accumulate, at PROBE_SHAPE (weight prepared beforehand)."""

    def int8_streaming_rows(self, route: int8_gemms.Int8Gemm, general: int8_gemms.Int8Gemm) -> int:
        """The most rows r (of STREAMING_ROWS) at which `route` is at least as fast as `general`, both at r and summed
        over the steps up to r, on a STREAMING_WEIGHT product whose weight comes from memory (the caches overwritten
        before each call); 0 if there is none."""


# Times a family's workload on given routes (route_workloads.time_routes, registered when backends.torch_eager is
# imported): the workloads run the backend's own ops, which import this module, so it is handed in, not imported.
RouteTimer = Callable[[torch.device, torch.dtype, str, tuple["Route", ...], int, int], dict[str, float]]
_route_timer: RouteTimer | None = None


def set_route_timer(timer: RouteTimer) -> None:
    """Install what DeviceProbe.route_times runs (route_workloads.py does, on import)."""
    global _route_timer
    _route_timer = timer


def _synchronize(device: torch.device) -> None:
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize()


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """The probe runs in one CPU thread: on a shared machine a multi-threaded GEMM stalls whenever another process holds
    one of its cores (100x on a busy 2-core machine), while the ratio of two kernels' speeds is a property of the
    kernels, not of the thread count."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class DeviceProbe:
    """The real measurements on the device: the families' workloads on each route (route_workloads.py), the int8
    routes at PROBE_SHAPE, the exactness checks. A speedup is the ratio of the best of PROBE_REPS alternating calls of
    each kernel (other processes only ever add time, so the minimum is what the
    hardware does, and alternating exposes both kernels to the same conditions)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._gen = torch.Generator().manual_seed(0)
        self._fp32_operands = self._operands(torch.float32)
        self._exactness_cases: list | None = None

    def _operands(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        m, k, n = PROBE_SHAPE
        a = torch.randn(m, k, generator=self._gen).to(self.device, dtype)
        b = torch.randn(k, n, generator=self._gen).to(self.device, dtype)
        return a, b

    def _timed(self, call: Callable[[], object]) -> float:
        _synchronize(self.device)
        start = time.perf_counter()
        call()
        _synchronize(self.device)
        return time.perf_counter() - start

    def _speedup_over_fp32(self, call: Callable[[], object]) -> float:
        a, b = self._fp32_operands

        def fp32_call() -> object:
            return a @ b

        fp32_call()  # warm-up: first-call setup (kernel selection, page faults) is not speed
        call()
        fp32_best = best = float("inf")
        for _ in range(PROBE_REPS):
            fp32_best = min(fp32_best, self._timed(fp32_call))
            best = min(best, self._timed(call))
        return fp32_best / best

    def route_times(self, dtype: torch.dtype, family: str, routes: tuple[Route, ...], rows: int) -> dict[str, float]:
        check(_route_timer is not None, RuntimeError, lambda: "no route timer: import backends.torch_eager first")
        return _route_timer(self.device, dtype, family, routes, rows, PROBE_REPS)

    def fp32_output(self, dtype: torch.dtype) -> bool:
        a = torch.ones(16, 16, dtype=dtype, device=self.device)
        try:
            return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except RUNTIME_ERRORS:
            return False  # no such overload in this torch, or no kernel for this device

    def native_gemm(self, dtype: torch.dtype, isa: str) -> tuple[bool, str]:
        if self.device.type != "cpu" or dtype != torch.bfloat16:
            return False, "the native kernel is a CPU bf16 GEMM"
        if isa == amx_gemm.FAST:  # AMX's GEMM is a kernel of its own (amx_gemm.c), with bmm_nt's contract
            ok, why = amx_gemm.availability()
            product = amx_gemm.bmm_nt
            return bf16_gemm.is_exact(self._gen, "amx_gemm_amx", product) if ok else (False, why)
        ok, why = bf16_gemm.availability(isa)
        return bf16_gemm.is_exact(self._gen, isa) if ok else (False, why)

    def residual_exact(self, dtype: torch.dtype) -> bool:
        a = torch.randn(3, 16, 256, generator=self._gen).to(self.device, dtype)
        b = torch.randn(3, 256, 48, generator=self._gen).to(self.device, dtype)
        want = torch.bmm(a.double(), b.double())
        try:
            rounded = torch.bmm(a, b)  # as backends/torch_eager/gemm.py asks for the residual: beta = -1
            batched = rounded.double() + torch.baddbmm(rounded, a, b, beta=-1).double()
            flat = rounded[0].double() + torch.addmm(rounded[0], a[0], b[0], beta=-1).double()
        except RUNTIME_ERRORS:
            return False
        # A rounded result is off by ~2^-9 of its size; a recovered one by ~2^-16 (two roundings of the residual).
        bound = 2.0**-13 * want.abs().amax()
        return bool((batched - want).abs().amax() <= bound and (flat - want[0]).abs().amax() <= bound)

    def int8_exact(self, route: int8_gemms.Int8Gemm) -> tuple[bool, str]:
        if self._exactness_cases is None:  # built once, shared by every route
            self._exactness_cases = int8_gemms.exactness_cases(self._gen, EXACTNESS_DEPTH)
        return int8_gemms.is_exact(route, self.device, self._exactness_cases)

    def int8_speedup(self, route: int8_gemms.Int8Gemm) -> float:
        m, k, n = PROBE_SHAPE
        x = torch.randint(-128, 128, (m, k), generator=self._gen, dtype=torch.int8).to(self.device)
        w = torch.randint(-128, 128, (n, k), generator=self._gen, dtype=torch.int8).to(self.device)
        prepared = route.prepare(w)
        return self._speedup_over_fp32(lambda: route.accumulate(x, prepared))

    def int8_streaming_rows(self, route: int8_gemms.Int8Gemm, general: int8_gemms.Int8Gemm) -> int:
        n, k = STREAMING_WEIGHT
        w = torch.randint(-128, 128, (n, k), generator=self._gen, dtype=torch.int8).to(self.device)
        prepared = {route.name: route.prepare(w), general.name: general.prepare(w)}
        # The routes that take part are CPU kernels (int8_gemms.NATIVE_VNNI and its rivals there).
        flush = torch.empty(cache_flush_bytes() // 4)
        totals = {route.name: 0.0, general.name: 0.0}  # sums of the best times over the steps so far
        rows_won = 0
        for rows in STREAMING_ROWS:
            x = torch.randint(-128, 128, (rows, k), generator=self._gen, dtype=torch.int8).to(self.device)
            best = {}
            for candidate in (general, route):
                candidate.accumulate(x, prepared[candidate.name])  # warm-up
                best[candidate.name] = float("inf")
            for _ in range(PROBE_REPS):  # alternating, the caches overwritten (untimed) before each call
                for candidate in (general, route):
                    flush.add_(1.0)
                    call = functools.partial(candidate.accumulate, x, prepared[candidate.name])
                    best[candidate.name] = min(best[candidate.name], self._timed(call))
            for name in totals:
                totals[name] += best[name]
            # A win at this step and over all steps so far: one close, noisy step (a single row, where both kernels
            # only stream the weight) neither decides alone nor hides the steps after it.
            if best[route.name] <= best[general.name] and totals[route.name] <= totals[general.name]:
                rows_won = rows
        return rows_won


# ------------------------------------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Route:
    """One way to run a family's products: `name` FP32 (fp32 operands), HALF (torch's GEMM with half-precision
    operands: fp32_output = it hands back fp32 by out_dtype, else its rounded result plus the residual GEMM), or
    NATIVE (the native kernel's fp32 result for products it takes; torch's rounded GEMM for the op's outputs).
    max_work: products whose half-precision GEMMs do more than this many times their own work (the parts of fp32
    operands times passes) take the fp32 GEMM: the measured speed ratio over the margin (inf: not measured)."""

    name: str
    fp32_output: bool = False
    max_work: float = math.inf
    isa: str = ""  # NATIVE: the kernels' build (NATIVE_ISAS, or "portable")
    # NATIVE: whether torch's own half GEMM is fast here (the device has units for the dtype); where not, the native
    # kernel also takes the op's outputs and what it cannot take runs in fp32 (gemm.Gemm.torch_half).
    torch_half: bool = True
    # NATIVE, where torch_half: the op's outputs too take the native kernel in products of fewer rows of work than
    # this, where it measured faster than one pass of torch's half GEMM (_native_outputs_below); 0: never.
    outputs_below: float = 0.0
    # NATIVE, sparse attention and the quantized indexer: how their kernel asks for the rows it reads next
    # (ROW_PREFETCHES), as measured fastest here (_with_row_prefetch); "": the kernel's default.
    prefetch: str = ""

    @property
    def label(self) -> str:
        """What the probe's times and `info` call the route: its name, and a native route's build (and row prefetch)."""
        label = f"{self.name}:{self.isa}" if self.isa else self.name
        return f"{label}+{self.prefetch}" if self.prefetch else label

    def describe(self, dtype: torch.dtype) -> str:
        unit = _unit(dtype)
        if self.name == FP32:
            return "fp32 operands"
        if self.name == NATIVE:
            outputs = ""
            if self.outputs_below == math.inf:
                outputs = "; the op's outputs too"
            elif self.outputs_below > 0:
                outputs = f"; the op's outputs too, below {self.outputs_below:.0f} rows"
            prefetch = f", rows prefetched {PREFETCH_WORDS[self.prefetch]}" if self.prefetch else ""
            text = f"{unit} operands, native kernels' fp32 result ({self.isa} build{outputs}{prefetch})"
        elif self.fp32_output:
            text = f"{unit} operands, fp32 result"
        else:
            text = f"{unit} operands, {unit} result + its rounding residual (addmm)"
        if math.isfinite(self.max_work):
            text += f", fp32 past {self.max_work:.1f}x work"
        return text


FP32_ROUTE = Route(FP32)


@dataclass(frozen=True)
class HalfChoice:
    """The route of one op family's products for `dtype` activations: `small` for products of fewer than
    `split_rows` rows (the weight family) or calls of fewer heads (sparse attention), `large` from there on (the same
    route for families measured at one shape), and why."""

    dtype: torch.dtype
    family: str
    small: Route
    large: Route
    reason: str
    split_rows: int = 1

    @property
    def use(self) -> bool:
        """Whether any of the family's products take half-precision operands."""
        return self.small.name != FP32 or self.large.name != FP32

    @property
    def native(self) -> bool:
        return NATIVE in (self.small.name, self.large.name)

    def route(self, rows: int) -> Route:
        return self.small if rows < self.split_rows else self.large

    @property
    def path(self) -> str:
        if self.small == self.large:
            return self.large.describe(self.dtype)
        return (
            f"{self.small.describe(self.dtype)} below {self.split_rows} {COUNT_UNITS.get(self.family, 'rows')}, "
            f"{self.large.describe(self.dtype)} from {self.split_rows}"
        )


@dataclass(frozen=True)
class Int8Choice:
    """The exact int8 GEMM the quantized ops use: an int8_gemms route name, or None for the chunked-fp32 path."""

    route: str | None
    reason: str
    # Products of at most this many rows run glm5-hal's native kernel instead of `route` (decode: the weight is
    # streamed from memory once and read in place); 0: none. The W4A8 kernel then also reads int4 at 4 bits.
    native_rows: int = 0
    native_reason: str = ""

    @property
    def path(self) -> str:
        path = self.route or "chunked fp32 GEMMs (exact, conservative)"
        if self.native_rows and self.route != int8_gemms.NATIVE_VNNI.name:
            path += f"; {int8_gemms.NATIVE_VNNI.name} up to {self.native_rows} rows"
        return path

    def takes_native(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs the native kernel (backends.torch_eager.native.int8_gemm)."""
        return self.route == int8_gemms.NATIVE_VNNI.name or 0 < rows <= self.native_rows


@dataclass(frozen=True)
class Capabilities:
    """The probe's answer for one device in one mode: the facts, and per GEMM kind what is used and why.

    half: per half-precision activation dtype, per op family (FAMILIES), the route of its products.
    """

    device: str
    mode: str
    facts: DeviceFacts | None  # None in OFF mode (nothing is probed)
    half: dict[torch.dtype, dict[str, HalfChoice]]
    int8: Int8Choice
    measured: dict[str, float] = field(default_factory=dict)  # times (ms) and speedups that were measured
    origin: str = ""  # where the answer came from: measured now (in how long), or read from the probe store

    def half_choice(self, dtype: torch.dtype, family: str = WEIGHTS) -> HalfChoice | None:
        """The route of `family`'s products for bf16 / fp16 activations; None for any other dtype (fp32 stays fp32)."""
        choices = self.half.get(dtype)
        return None if choices is None else choices[family]

    def int8_route(self) -> int8_gemms.Int8Gemm | None:
        return None if self.int8.route is None else int8_gemms.by_name(self.int8.route)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: what `glm5-hal info --json` and `glm5-hal bench --json` record."""
        facts = None
        if self.facts is not None:
            facts = {
                "description": self.facts.description,
                "units": self.facts.units,
                "evidence": self.facts.evidence,
                "measure_speed": self.facts.measure_speed,
            }
        half = {
            _unit(d): {
                family: {"path": c.path, "used": c.use, "reason": c.reason, "ops": FAMILY_OPS[family]}
                for family, c in choices.items()
            }
            for d, choices in self.half.items()
        }
        return {
            "device": self.device,
            "mode": self.mode,
            "env": f"{ENV_FAST_PATHS}={os.environ.get(ENV_FAST_PATHS, '')}",
            "facts": facts,
            **half,
            "int8": {
                "path": self.int8.path,
                "reason": self.int8.reason,
                "native_rows": self.int8.native_rows,
                "native_reason": self.int8.native_reason,
            },
            "measured": self.measured,
            "origin": self.origin,
            "summary": self.describe(),
        }

    def describe(self) -> list[str]:
        """One line per GEMM kind and op family: the route and why (`glm5-hal info`, `glm5-hal bench`)."""
        head = f"{self.device}: fast paths {self.mode}"
        if self.facts is not None:
            head += f" on {self.facts.description}"
        lines = [head]
        if self.origin:
            lines.append(f"  probe: {self.origin}")
        for dtype, choices in self.half.items():
            for family, c in choices.items():
                lines.append(f"  {_unit(dtype)} {family} ({FAMILY_OPS[family]}): {c.path} ({c.reason})")
        lines.append(f"  int8 GEMM (W8A8 / W4A8): {self.int8.path} ({self.int8.reason})")
        if self.int8.native_reason:
            lines.append(f"    few rows: {self.int8.native_reason}")
        return lines


def to_stored(found: Capabilities) -> dict[str, object]:
    """`found` as plain JSON data for the probe store (probe_store.py); from_stored reads it back."""
    facts = None if found.facts is None else vars(found.facts)
    half = {
        _unit(d): {
            f: {**vars(c), "dtype": _unit(d), "small": vars(c.small), "large": vars(c.large)} for f, c in fs.items()
        }
        for d, fs in found.half.items()
    }
    return {
        "device": found.device,
        "mode": found.mode,
        "facts": facts,
        "half": half,
        "int8": vars(found.int8),
        "measured": found.measured,
    }


def from_stored(data: dict[str, object], origin: str) -> Capabilities:
    """The Capabilities `to_stored` wrote; KeyError / TypeError / ValueError where the data is not such a record."""
    half = {
        getattr(torch, unit): {
            family: HalfChoice(
                getattr(torch, unit), family, Route(**c["small"]), Route(**c["large"]), c["reason"], c["split_rows"]
            )
            for family, c in families.items()
        }
        for unit, families in data["half"].items()
    }
    check(
        set(half) == set(HALF_DTYPES) and all(set(f) == set(FAMILIES) for f in half.values()),
        ValueError,
        lambda: "stored routes: not every dtype and family",
    )
    facts = None if data["facts"] is None else DeviceFacts(**data["facts"])
    int8 = Int8Choice(**data["int8"])
    return Capabilities(data["device"], data["mode"], facts, half, int8, dict(data["measured"]), origin)


def _everywhere(dtype: torch.dtype, route: Route, reason: str) -> dict[str, HalfChoice]:
    return {family: HalfChoice(dtype, family, route, route, reason) for family in FAMILIES}


@functools.cache
def _conservative(device: str) -> Capabilities:
    reason = f"{ENV_FAST_PATHS}=0"
    half = {d: _everywhere(d, FP32_ROUTE, reason) for d in HALF_DTYPES}
    return Capabilities(device, OFF, None, half, Int8Choice(None, reason))


def _speed_verdict(speedup: float, what: str) -> tuple[bool, str]:
    if speedup >= MIN_SPEEDUP:
        return True, f"measured {speedup:.2f}x the fp32 GEMM"
    return False, f"{what} measured {speedup:.2f}x the fp32 GEMM (a fast path needs >= {MIN_SPEEDUP}x)"


def _correct_routes(dtype: torch.dtype, probe: Probe, torch_half: bool = True) -> tuple[list[Route], str]:
    """The routes that give fp32-accurate products for `dtype` operands on the device (fp32 always), and what the
    checks found: torch's GEMM needs an fp32 result or a residual that recovers its rounding (fp16: an fp32 result,
    since an fp16 one could overflow where fp32 does not); the native kernel needs to be exact here. torch_half:
    whether torch's own half GEMM is a candidate at all (not on a CPU without units for the dtype, where it is
    emulated, ~15x slower than fp32; the native builds widen bf16 to fp32 in registers and need no such unit)."""
    unit = _unit(dtype)
    routes = [FP32_ROUTE]
    fp32_output = probe.fp32_output(dtype)
    notes = []
    if not torch_half:
        pass
    elif fp32_output:
        routes.append(Route(HALF, fp32_output=True))
    elif dtype == torch.float16:
        notes.append("fp16 GEMMs here return fp16 only (no out_dtype=float32): products that fit fp32 could overflow")
    elif probe.residual_exact(dtype):
        routes.append(Route(HALF))
    else:
        notes.append(f"{unit} GEMMs here return {unit} only and addmm rounds before it adds (no residual route)")
    if dtype == torch.bfloat16 and not fp32_output:
        for isa in native_isas():
            native, why = probe.native_gemm(dtype, isa)
            if native:
                routes.append(Route(NATIVE, fp32_output=True, isa=isa))
            notes.append(f"native kernel: {why}")
    return routes, "; ".join(notes)


def native_isas() -> tuple[str, ...]:
    """The native builds a NATIVE route may use here: NATIVE_ISAS that build.py knows, or only the portable build
    under GLM5_HAL_NATIVE=portable."""
    if build.native_mode() == build.PORTABLE_ONLY:
        return ("portable",)
    return tuple(isa for isa in NATIVE_ISAS if isa in build.ISAS)


def _fastest(times: dict[str, float], routes: list[Route]) -> tuple[Route, float]:
    """The fastest route of `times` (fp32 unless another beats it by ROUTE_MARGIN) and its speed ratio over fp32."""
    best = min((r for r in routes if r.name != FP32), key=lambda r: times[r.label], default=FP32_ROUTE)
    ratio = times[FP32] / times[best.label] if best.name != FP32 else 1.0
    if ratio < ROUTE_MARGIN:
        return FP32_ROUTE, 1.0
    return replace(best, max_work=ratio / ROUTE_MARGIN), ratio


def _crossing(
    small: dict[str, float], large: dict[str, float], first: str, second: str, counts: tuple[int, int]
) -> int:
    """The count (rows, heads) from which route `second` is faster than `first`, on lines through their times at
    counts[0] (`small`) and counts[1] (`large`): the cost model a two-count family's split comes from."""
    low, high = counts
    slope = {name: (large[name] - small[name]) / (high - low) for name in (first, second)}
    gap = small[second] - small[first]  # > 0: second is slower at `low`
    closing = slope[first] - slope[second]
    if closing <= 0:
        return high
    return max(low + 1, min(high, low + math.ceil(gap / closing)))


def output_label(route: Route) -> str:
    """The weight family's measured time of `route`'s product as an op's output (route_times): for the half route,
    one pass of torch's GEMM, its rounded result being all an output needs."""
    return f"{route.label} output"


def _native_outputs_below(
    small: dict[str, float], large: dict[str, float], native: Route, half: Route, counts: tuple[int, int]
) -> float:
    """The rows below which the weight family's `native` route also takes the op's outputs: where it is faster, by
    ROUTE_MARGIN, than torch's half GEMM of an output (one pass, measured as output_label(half)), on lines through
    both times at counts[0] (`small`) and counts[1] (`large`). inf: faster at both counts; 0: slower at the decode
    count (a win only at prefill is left to torch's GEMM) or not measured."""
    label = output_label(half)
    if native.name != NATIVE or label not in small or label not in large:
        return 0.0
    low, high = counts
    ours = [times[native.label] * ROUTE_MARGIN for times in (small, large)]
    theirs = [times[label] for times in (small, large)]
    if ours[0] > theirs[0]:
        return 0.0
    if ours[1] <= theirs[1]:
        return math.inf
    # ours starts below theirs and ends above: where the lines cross.
    closing = (ours[1] - ours[0]) - (theirs[1] - theirs[0])
    return float(math.ceil(low + (theirs[0] - ours[0]) * (high - low) / closing))


def _two_part_split(
    small: dict[str, float], large: dict[str, float], native: str, counts: tuple[int, int]
) -> int | None:
    """For a weight family whose one route is `native`: the rows of work (an fp32 activation's rows x its two parts,
    as gemm.RoutedGemm counts them) from which such a product costs more on it, by ROUTE_MARGIN, than on the fp32
    GEMM at its own rows, on the lines through both routes' times at counts[0] (`small`) and counts[1] (`large`);
    None where that is past twice the larger count (the native route is over twice as fast at prefill too)."""
    low, high = counts

    def line(route: str) -> tuple[float, float]:  # (time at 0 rows, time per row)
        slope = (large[route] - small[route]) / (high - low)
        return small[route] - slope * low, slope

    (native_at_0, native_slope), (fp32_at_0, fp32_slope) = line(native), line(FP32)
    # Where native(x) x margin = fp32(x / 2), for x rows of work.
    closing = native_slope * ROUTE_MARGIN - fp32_slope / 2
    gap = fp32_at_0 - native_at_0 * ROUTE_MARGIN
    if closing <= 0 or gap >= 2 * high * closing:
        return None
    return max(low + 1, math.ceil(gap / closing))


def _measured_choice(
    dtype: torch.dtype, family: str, routes: list[Route], probe: Probe, measured: dict[str, float], why: str
) -> HalfChoice:
    unit = _unit(dtype)
    counts = MEASURED_COUNTS.get(family, (DECODE_ROWS,))
    what = COUNT_UNITS.get(family, "")
    times = {}
    for count in counts:
        times[count] = probe.route_times(dtype, family, tuple(routes), count)
        for name, seconds in times[count].items():
            at = f" {count} {what}" if len(counts) > 1 else ""
            measured[f"{unit} {family} {name}{at} (ms)"] = round(seconds * 1e3, 4)
    small, small_ratio = _fastest(times[counts[0]], routes)
    large, large_ratio = _fastest(times[counts[-1]], routes)
    split = None
    if family == WEIGHTS:
        # An fp32 activation doubles a product's rows on a half route (two stacked parts), and the weight family's
        # products pick their route by those rows (gemm.RoutedGemm). On the native kernel at decode twice the rows
        # cost far less than twice (the weight is read once): no work bound there. At prefill the arithmetic sets
        # the time, so a large native route keeps its bound (an fp32 activation's two parts are twice the work) from
        # the rows of work where the doubled rows stop paying (_two_part_split). The half route keeps its bound (its
        # fp32 weights would enter in two parts and the residual doubles its passes).
        if small.name == NATIVE:
            small = replace(small, max_work=math.inf)
        half = next((r for r in routes if r.name == HALF), None)
        if half is not None:  # the op's outputs: the native kernel against one pass of torch's half GEMM
            below = _native_outputs_below(times[counts[0]], times[counts[-1]], small, half, counts)
            small, large = (replace(r, outputs_below=below) if r.name == NATIVE else r for r in (small, large))
        if small.name == large.name == NATIVE and small.label == large.label:
            split = _two_part_split(times[counts[0]], times[counts[-1]], large.label, counts)
            if split is None:
                large = small

    def verdict(route: Route, ratio: float, where: str) -> str:
        if route.name == FP32:
            return f"fp32 fastest {where} (others within {ROUTE_MARGIN}x or slower)"
        return f"{route.label} measured {ratio:.2f}x fp32 {where}"

    if split is not None:  # one native route, its fp32 activations' products bounded from `split` rows of work on
        reason = (
            f"{verdict(large, large_ratio, 'at the measured shapes')}; an fp32 activation's two parts stop paying "
            f"from {split} {what} of them"
        )
        return HalfChoice(dtype, family, small, large, f"{why}{reason}", split)
    if len(counts) == 1 or small.label == large.label:
        route = large if small.label == large.label else small
        reason = verdict(route, large_ratio if len(counts) > 1 else small_ratio, "at the measured shapes")
        return HalfChoice(dtype, family, route, route, f"{why}{reason}")
    low, high = counts
    split = _crossing(times[low], times[high], small.label, large.label, counts)
    reason = (
        f"{verdict(small, small_ratio, f'at {low} {what}')}, {verdict(large, large_ratio, f'at {high}')}"
        f"; lines through both cross at {split} {what}"
    )
    return HalfChoice(dtype, family, small, large, f"{why}{reason}", split)


def _with_row_prefetch(choice: HalfChoice, probe: Probe, measured: dict[str, float]) -> HalfChoice:
    """`choice` (sparse attention's or the quantized indexer's) with each native route's row prefetch
    (ROW_PREFETCHES) the one that measured fastest with the rows coming from memory (FROM_MEMORY), at the head count
    the route serves (summed over both counts where it serves every call). The hints give the same results; which is
    fastest is the CPU's: over 2048 scattered rows out of L3, into L2 was the fastest on a Zen 4 and the slowest on a
    Zen 5 (row_prefetch.h). Ties keep the kernel's default hint (DEFAULT_PREFETCHES), which is tried first."""
    family, unit = choice.family, _unit(choice.dtype)
    counts = PREFETCH_COUNTS[family]
    default = DEFAULT_PREFETCHES[family]
    hints = (default, *(h for h in ROW_PREFETCHES if h != default))
    found = []

    def fastest_hint(route: Route, heads: tuple[int, ...]) -> Route:
        if route.name != NATIVE:
            return route
        hinted = tuple(replace(route, prefetch=hint) for hint in hints)
        totals = dict.fromkeys(hints, 0.0)
        for count in heads:
            times = probe.route_times(choice.dtype, FROM_MEMORY[family], hinted, count)
            for r in hinted:
                totals[r.prefetch] += times[r.label]
                measured[f"{unit} {family} {r.label} {count} heads, rows from memory (ms)"] = round(
                    times[r.label] * 1e3, 4
                )
        best = min(hints, key=totals.__getitem__)
        ratio = totals[default] / totals[best]
        found.append(f"{route.label} rows {PREFETCH_WORDS[best]} ({ratio:.2f}x the default from memory)")
        return replace(route, prefetch=best)

    if choice.small == choice.large:
        route = fastest_hint(choice.large, counts)
        small = large = route
    else:
        small, large = fastest_hint(choice.small, counts[:1]), fastest_hint(choice.large, counts[1:])
    reason = f"{choice.reason}; {', '.join(found)}" if found else choice.reason
    return replace(choice, small=small, large=large, reason=reason)


def _decide_half(
    dtype: torch.dtype, facts: DeviceFacts, probe: Probe, mode: str, measured: dict[str, float]
) -> dict[str, HalfChoice]:
    unit = _unit(dtype)
    no_units = mode == AUTO and facts.units[unit] is False
    if no_units and (dtype != torch.bfloat16 or facts.device != "cpu"):  # the native kernels are CPU bf16 ones
        return _everywhere(dtype, FP32_ROUTE, f"no {unit} units: {facts.evidence[unit]}")
    routes, notes = _correct_routes(dtype, probe, torch_half=not no_units)
    if facts.units[unit] is False:  # torch's half GEMM is emulated here: the native routes must not lean on it
        routes = [replace(r, torch_half=False) if r.name == NATIVE else r for r in routes]
    notes = f"{notes}; " if notes else ""
    if len(routes) == 1:
        if no_units:
            return _everywhere(dtype, FP32_ROUTE, f"no {unit} units: {facts.evidence[unit]}; {notes.rstrip('; ')}")
        return _everywhere(dtype, FP32_ROUTE, f"no fp32-accurate {unit} route: {notes.rstrip('; ')}")
    fastest_kind = next((r for r in routes if r.name == NATIVE), routes[1])  # NATIVE_ISAS: fastest first
    if mode == FORCE:  # the native route then takes the op's outputs too: every product on the forced kernels
        forced = replace(fastest_kind, outputs_below=math.inf) if fastest_kind.name == NATIVE else fastest_kind
        return _everywhere(dtype, forced, f"{ENV_FAST_PATHS}=1; {notes}".rstrip("; "))
    if facts.units[unit] is None:
        known = f"{unit} units unknown here; "
    else:
        known = f"{unit} units: {facts.evidence[unit]}; " if facts.units[unit] else f"no {unit} units; "
    if not facts.measure_speed:  # the accelerators GLM-5 targets: their half-precision units are the fast path
        return _everywhere(dtype, fastest_kind, f"{known}{notes}".rstrip("; "))
    choices = {}
    for family in FAMILIES:
        try:
            choices[family] = _measured_choice(dtype, family, routes, probe, measured, f"{known}{notes}")
            if family in FROM_MEMORY:
                choices[family] = _with_row_prefetch(choices[family], probe, measured)
        except RUNTIME_ERRORS as exc:  # an unknown device without such a GEMM
            reason = f"{unit} products do not run here ({str(exc).splitlines()[0][:160]})"
            choices[family] = HalfChoice(dtype, family, FP32_ROUTE, FP32_ROUTE, reason)
    return choices


def _decide_int8(facts: DeviceFacts, probe: Probe, mode: str, measured: dict[str, float]) -> Int8Choice:
    if mode == AUTO and facts.units["int8"] is False:
        return Int8Choice(None, f"no int8 dot-product units: {facts.evidence['int8']}")
    rejected, exact = [], []
    for route in int8_gemms.ROUTES:
        ok, why = probe.int8_exact(route)
        (exact if ok else rejected).append(route if ok else f"{route.name}: {why}")
    if not exact:
        return Int8Choice(None, "no exact int8 GEMM: " + "; ".join(rejected))
    exactness = f"{EXACTNESS_DEPTH}-deep -128/127 check passed"
    if mode == FORCE:  # glm5-hal's own kernels first (AMX's, then VNNI's), so that forcing runs them at every size
        own = [r for r in exact if r in (int8_gemms.AMX_S8, int8_gemms.NATIVE_VNNI)]
        return Int8Choice((own or exact)[0].name, f"{ENV_FAST_PATHS}=1; {exactness}")
    if not facts.measure_speed:
        return Int8Choice(exact[0].name, f"int8 units: {facts.evidence['int8']}; {exactness}")
    # The first exact route (int8_gemms.ROUTES is in order of preference) that beats fp32 is used. The order is a
    # fact about the kernels the probe shape cannot show: a prepacked weight saves a reorder per call, which
    # dominates at decode, where the weight is streamed from memory once per call.
    verdicts = []
    for route in exact:
        try:
            speedup = measured[f"{route.name} (int8)"] = probe.int8_speedup(route)
        except RUNTIME_ERRORS as exc:
            verdicts.append(f"{route.name} fails at the probe shape ({str(exc).splitlines()[0][:160]})")
            continue
        use, why = _speed_verdict(speedup, route.name)
        if use:
            return _with_native_rows(Int8Choice(route.name, f"{exactness}; {why}"), route, exact, probe)
        verdicts.append(why)
    return Int8Choice(None, "; ".join(verdicts))


def _with_native_rows(choice: Int8Choice, general: int8_gemms.Int8Gemm, exact: list, probe: Probe) -> Int8Choice:
    """`choice` with the row count up to which the native kernel replaces `general`, where it is exact here and
    measured at least as fast on a weight streamed from memory (decode)."""
    native = int8_gemms.NATIVE_VNNI
    if general is native:
        return choice
    if native not in exact:
        return replace(choice, native_reason=f"{native.name} is not used: not exact or not available here")
    try:
        rows = probe.int8_streaming_rows(native, general)
    except RUNTIME_ERRORS as exc:
        return replace(choice, native_reason=f"{native.name} failed the streaming check ({str(exc)[:160]})")
    if not rows:
        return replace(choice, native_reason=f"{native.name} measured slower than {general.name} at every row count")
    why = f"{native.name} measured at least as fast as {general.name} up to {rows} rows (weight from memory)"
    return replace(choice, native_rows=rows, native_reason=why)


def decide(facts: DeviceFacts, probe: Probe, mode: str) -> Capabilities:
    """The choices for a device from its facts and (where needed) the probe's measurements, in AUTO or FORCE mode
    (OFF needs neither). Pure given `probe`: the unit tests pass fake facts and a fake probe."""
    check(mode in (AUTO, FORCE), ValueError, lambda: f"mode: expected {AUTO!r} or {FORCE!r}, got {mode!r}")
    measured: dict[str, float] = {}
    half = {d: _decide_half(d, facts, probe, mode, measured) for d in HALF_DTYPES}
    int8 = _decide_int8(facts, probe, mode, measured)
    return Capabilities(facts.device, mode, facts, half, int8, measured)


# ------------------------------------------------------------------------------------------------ the cache

_cache: dict[tuple[str, str, bool], Capabilities] = {}
_lock = threading.RLock()  # re-entrant: a probe's own op calls fail loudly instead of hanging
# (torch.device, what sets the mode, what sets native_enabled) -> the answer: the lookup every op call makes, kept to
# one dictionary read (parsing the settings and naming the device cost ~0.02 ms once a model's other layers have
# evicted the caches, against a 0.13 ms decode GEMM). A device without an index is not kept here: which device it
# means can change (torch.cuda.set_device).
_recent: dict[tuple[torch.device, object, object], Capabilities] = {}


def _device_key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return device


def capabilities(device: torch.device | str, mode: str | None = None) -> Capabilities:
    """The choices for `device` in `mode` (default: fast_paths_mode()), probed once per process, device and mode."""
    recent = None
    if mode is None and isinstance(device, torch.device) and (device.index is not None or device.type == "cpu"):
        recent = (device, _override[-1] if _override else raw_setting(ENV_FAST_PATHS), raw_setting(build.ENV_NATIVE))
        found = _recent.get(recent)
        if found is not None:
            return found
    found = _capabilities(device, mode)
    if recent is not None:
        _recent[recent] = found
    return found


def _capabilities(device: torch.device | str, mode: str | None) -> Capabilities:
    mode = fast_paths_mode() if mode is None else parse_mode(mode)
    device = _device_key(device)
    if mode == OFF:
        return _conservative(str(device))
    key = (str(device), mode, build.native_mode())
    found = _cache.get(key)
    if found is None:
        with _lock:  # one probe per device even if several threads ask at once
            found = _cache.get(key)
            if found is None:
                found = _cache[key] = _stored_or_measured(device, mode)
    return found


def _stored_or_measured(device: torch.device, mode: str) -> Capabilities:
    """The decisions the probe store keeps for this key, else measured now and kept (probe_store.py)."""
    store_key = probe_store.key(device, mode)
    stored = probe_store.load(store_key)
    if stored is not None:
        try:
            return from_stored(
                stored,
                f"read from {probe_store.path_for(store_key)} ({probe_store.ENV_REPROBE}=1 or "
                "`glm5-hal info --reprobe` measures again)",
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            pass  # a record this code cannot read: measure again and replace it
    started = time.perf_counter()
    facts = device_facts(device)
    with _one_cpu_thread(device):
        found = decide(facts, DeviceProbe(device), mode)
    seconds = time.perf_counter() - started
    where = probe_store.save(store_key, to_stored(found))
    kept = f"kept in {where}" if where is not None else "not kept (no usable cache folder)"
    return replace(found, origin=f"measured in {seconds:.2f} s, {kept}")


def clear_cache() -> None:
    """Forget every probe result (tests; a process whose thread count changed and wants a fresh measurement)."""
    with _lock:
        _cache.clear()
        _recent.clear()
