"""Device peaks for the roofline: a table for known accelerators, or measured on the spot (--measure-peaks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perf.timing import time_calls


@dataclass(frozen=True)
class Peaks:
    name: str
    flops: float  # dense matmul FLOP/s at the benchmark's dtype
    int8_ops: float  # int8 matmul OP/s
    bandwidth: float  # bytes/s
    source: str  # "table" or "measured"

    def bound_s(self, flops: float, nbytes: float, *, int8: bool = False) -> float:
        """Roofline time: the larger of compute time at peak and traffic time at peak bandwidth."""
        return max(flops / (self.int8_ops if int8 else self.flops), nbytes / self.bandwidth)


# Dense (no sparsity) vendor figures. bf16 tensor-core / int8 / memory bandwidth.
KNOWN: dict[str, tuple[float, float, float]] = {
    "H100": (989e12, 1979e12, 3.35e12),
    "H200": (989e12, 1979e12, 4.8e12),
    "H800": (989e12, 1979e12, 3.35e12),
    "H20": (148e12, 296e12, 4.0e12),
    "A100": (312e12, 624e12, 2.0e12),
    "A800": (312e12, 624e12, 2.0e12),
}


def table_peaks(device: torch.device) -> Peaks | None:
    """The table entry whose name occurs in the device's name (CUDA only), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (flops, int8_ops, bw) in KNOWN.items():
        if key in name:
            return Peaks(name, flops, int8_ops, bw, "table")
    return None


def measure_peaks(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 2048) -> Peaks:
    """A large GEMM (in `dtype`, and int8 through torch._int_mm where it runs) and a large copy, timed here."""
    a = [torch.randn(size, size, device=device, dtype=dtype) for _ in range(2)]
    gemm = time_calls(lambda x: x["a"] @ x["a"], [{"a": t} for t in a], device, reps=5)
    flops = 2.0 * size**3 / gemm.median_s
    src = torch.randn(64 * 2**20 // 4, device=device)  # 64 MiB: past the caches
    dst = torch.empty_like(src)
    copy = time_calls(lambda x: dst.copy_(x["s"]), [{"s": src}], device, reps=5)
    bandwidth = 2 * src.numel() * 4 / copy.median_s  # read + write
    # int8: torch._int_mm where it runs; never below the float GEMM (on CPUs _int_mm can be far slower than an
    # exact int8 GEMM built from float matmuls, which is what the torch backend does there).
    int8_ops = flops
    try:
        q = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=device)
        mm = time_calls(lambda x: torch._int_mm(x["q"], x["q"]), [{"q": q}], device, reps=3, max_seconds=2.0)
        int8_ops = max(flops, 2.0 * size**3 / mm.median_s)
    except RuntimeError:
        pass
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{device.type} ({torch.get_num_threads()} threads)"
    )
    return Peaks(name, flops, int8_ops, bandwidth, "measured")
