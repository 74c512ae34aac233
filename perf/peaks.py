"""Device peaks for the roofline: a table of vendor figures for known accelerators, or measured on the spot.

`measure_peaks` times, on the device itself, a large dense GEMM (fp32 and the benchmark dtype: the faster one is
the matmul peak), the fastest int8 GEMM torch offers there, and a large copy (read + write). CPUs are not in the
table, so on a CPU the peaks are always measured, in the same run as the ops they judge.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backends.torch_eager import int8_gemms
from perf.timing import device_module, time_calls


@dataclass(frozen=True)
class Peaks:
    """What the device can do at best: the roofline every op is judged against."""

    name: str
    flops: float  # dense matmul FLOP/s (the faster of fp32 and the benchmark dtype)
    int8_ops: float  # int8 matmul OP/s (never below `flops`: an int8 GEMM can always run as a float one)
    bandwidth: float  # memory bandwidth, bytes/s
    source: str  # "table (vendor figures)" or "measured"
    detail: str = ""  # what was measured: per-dtype GEMM rates, which int8 GEMM won

    def bound_s(self, flops: float, nbytes: float, *, int8: bool = False) -> float:
        """Roofline time of a call: the larger of its compute time at the matmul peak and its traffic time at the
        peak bandwidth (so achieved / roofline = min(peak, bandwidth * intensity) / achieved FLOP/s)."""
        return max(flops / (self.int8_ops if int8 else self.flops), nbytes / self.bandwidth)


# Dense (no sparsity) vendor figures: (bf16 tensor FLOP/s, int8 OP/s, memory bytes/s); None where no figure is in
# the project's sources (shared/reference lists none for Ascend), so those devices are measured on the spot.
KNOWN: dict[str, tuple[float, float, float] | None] = {
    "H100": (989e12, 1979e12, 3.35e12),  # SXM
    "H200": (989e12, 1979e12, 4.8e12),
    "H800": (989e12, 1979e12, 3.35e12),
    "H20": (148e12, 296e12, 4.0e12),
    "A100": (312e12, 624e12, 2.0e12),  # SXM 80GB
    "A800": (312e12, 624e12, 2.0e12),
    "910B": None,
    "910C": None,
}


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name (from its torch module), or a CPU description."""
    module = device_module(device)
    if module is not None and hasattr(module, "get_device_name"):
        return str(module.get_device_name(device))
    return f"{device.type} ({torch.get_num_threads()} threads)"


def table_peaks(device: torch.device) -> Peaks | None:
    """Vendor figures of the table entry named in the device's name; None if the device is not in the table or its
    figures are unknown (the caller then measures)."""
    if device.type == "cpu":
        return None
    name = device_name(device)
    for key, figures in KNOWN.items():
        if key in name and figures is not None:
            flops, int8_ops, bandwidth = figures
            return Peaks(name, flops, int8_ops, bandwidth, "table (vendor figures)")
    return None


# A GEMM is timed at growing sizes until one call takes this long: big enough to reach the peak (launch and
# threading overheads amortised), and a slow path (bf16 on a CPU without bf16 units) stops at a small size.
MIN_CALL_S = 0.05
FIRST_SIZE = 256


def _square_gemm_rate(make: Callable[[int], Callable[[dict], object]], device: torch.device, max_size: int) -> float:
    """OP/s of size^3 GEMMs made by make(size), the size doubling from FIRST_SIZE until a call takes MIN_CALL_S
    (or max_size is reached)."""
    size = FIRST_SIZE
    while True:
        timing = time_calls(make(size), [{}], device, warmup=1, reps=5, max_seconds=1.0)
        if timing.median_s >= MIN_CALL_S or 2 * size > max_size:
            return 2.0 * size**3 / timing.median_s
        size *= 2


def _float_gemm(device: torch.device, dtype: torch.dtype) -> Callable[[int], Callable[[dict], object]]:
    def make(size: int) -> Callable[[dict], object]:
        a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
        return lambda _: a @ b

    return make


def _int8_gemms(device: torch.device) -> dict[str, Callable[[int], Callable[[dict], object]]]:
    """The int8 GEMMs torch can run here (the fastest counts as the int8 peak): the exact routes of
    backends.torch_eager.int8_gemms (torch._int_mm; oneDNN u8 x s8 with a prepacked weight, prepared before timing), and
    on a CPU the quantized engine's linear (fbgemm / oneDNN, u8 x s8, not necessarily exact)."""

    def route_gemm(route: int8_gemms.Int8Gemm) -> Callable[[int], Callable[[dict], object]]:
        def make(size: int) -> Callable[[dict], object]:
            a, b = (torch.randint(-127, 128, (size, size), dtype=torch.int8, device=device) for _ in range(2))
            prepared = route.prepare(b)
            return lambda _: route.accumulate(a, prepared)

        return make

    def quantized_linear(size: int) -> Callable[[dict], object]:
        with warnings.catch_warnings():  # quantized tensors are deprecated, yet still the CPU's int8 GEMM in 2.13
            warnings.simplefilter("ignore")
            x = torch.quantize_per_tensor(torch.randn(size, size), 0.05, 128, torch.quint8)
            w = torch.quantize_per_tensor(torch.randn(size, size), 0.05, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(w, None)
        return lambda _: torch.ops.quantized.linear(x, packed, 1.0, 0)

    gemms = {r.name: route_gemm(r) for r in int8_gemms.ROUTES if r.applies(FIRST_SIZE, FIRST_SIZE, FIRST_SIZE, device)}
    if device.type == "cpu":
        gemms[f"quantized.linear ({torch.backends.quantized.engine})"] = quantized_linear
    return gemms


def measure_peaks(device: torch.device, dtype: torch.dtype = torch.bfloat16, max_size: int = 8192) -> Peaks:
    """Time GEMMs (fp32 and `dtype`; the int8 ones of `_int8_gemms`) at growing sizes up to max_size, and a copy
    past the caches; a GEMM that does not run here is left out (the detail says which ran)."""
    rates = {
        str(d).removeprefix("torch."): _square_gemm_rate(_float_gemm(device, d), device, max_size)
        for d in dict.fromkeys((torch.float32, dtype))
    }
    flops = max(rates.values())

    int8_rates: dict[str, float] = {}
    for label, make in _int8_gemms(device).items():
        try:
            int8_rates[label] = _square_gemm_rate(make, device, max_size)
        except (RuntimeError, NotImplementedError, AttributeError):
            continue  # this GEMM does not run on this device / build
    best_int8 = max(int8_rates, key=int8_rates.__getitem__, default=None)
    int8_ops = max([flops, *int8_rates.values()])

    # 256 MiB on accelerators (past a 50 MB L2), 64 MiB on CPUs (past the last-level cache, quick to time).
    copy_bytes = (64 if device.type == "cpu" else 256) * 2**20
    sets = [{"src": torch.empty(copy_bytes // 4, device=device).uniform_()} for _ in range(2)]
    dst = torch.empty_like(sets[0]["src"])
    copy = time_calls(lambda x: dst.copy_(x["src"]), sets, device, warmup=1, reps=7)
    bandwidth = 2.0 * copy_bytes / copy.median_s  # every byte read once and written once

    detail = ", ".join(f"{k} GEMM {v / 1e12:.3f} TFLOP/s" for k, v in rates.items())
    detail += "; int8: " + (
        ", ".join(f"{k} {v / 1e12:.3f} TOP/s" for k, v in int8_rates.items()) if int8_rates else "none runs"
    )
    if best_int8 is None or int8_rates[best_int8] < flops:
        detail += " (below the float GEMM: the float rate counts)"
    detail += f"; copy of {copy_bytes >> 20} MiB"
    return Peaks(device_name(device), flops, int8_ops, bandwidth, "measured", detail)
