"""Compile the Triton backend's kernels for a GPU on a machine without one: the check CI can make of GPU code.

    python -m backends.triton.compile_check                      # sm_90 (H100 / H200), the quick case set
    python -m backends.triton.compile_check --arch 80 --cases all --ops sparse_flash_attention

Why it exists: CI runs the kernels under Triton's CPU interpreter, which accepts code that Triton's GPU compiler
rejects. The first session lent a GPU (an H200, Triton 3.6) found two such kernels: a tuple holding a dtype in
sparse attention, and an int8 `tl.dot` into an int32 accumulator without `out_dtype`. Here every kernel launch of
the parity cases becomes a compile for the named target, through Triton's own front end, optimizer and ptxas (all
in the triton wheel; no GPU or driver needed). Reported: a kernel that does not compile, and a kernel that needs
more shared memory than the target's block may have (launched as it is, or in every autotuning configuration).

What it cannot see: nothing runs, so no output is checked. A miscompiled kernel (the same H200 summed replicated
lanes in the Hadamard kernel's old mixing step) needs the GPU: the parity suite with GLM5_HAL_BACKEND=triton and
perf/triton_gpu.py there.

Run it in a process of its own: triton must be imported here with the interpreter off, before anything switches
the interpreter on (backends/triton/runtime.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

# Most shared memory one block may use (bytes, with the opt-in to the large carve-out), per compute capability.
MAX_SHARED_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
CHECK_BACKEND = "triton-compile-check"
# The quick set, per op: its first case, its cases at real model dims (the shapes, block sizes and autotuning keys
# GLM-5 and DeepSeek-V3.2 run) and its first case in each quantized cache format (a format changes the kernel's
# code path, not its blocking), in both dtypes, autotuned kernels compiled up to their first configuration that
# fits: ~2 minutes cold on 2 cores. `--cases all`: every parity case, every configuration (tens of minutes).
CACHE_FORMAT_WORDS = ("fp8_ds_mla", "int8_mla", "fp8_index", "int8_index")


@dataclass
class Report:
    """Per kernel, the shared-memory sizes of its compiled variants; the cases that raised, with why."""

    arch: int
    shared: dict[str, set[int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    cases: int = 0

    def lines(self) -> list[str]:
        limit = MAX_SHARED_BYTES.get(self.arch)
        out = [f"sm_{self.arch}: {self.cases} case runs, {len(self.shared)} kernels compiled"]
        for name, sizes in sorted(self.shared.items()):
            over = [s for s in sizes if limit is not None and s > limit]
            note = f"  ({len(over)} variants over {limit} bytes: autotuning skips those)" if over else ""
            out.append(f"  {name:<34} shared memory {min(sizes)}..{max(sizes)} bytes{note}")
        out += [f"ERROR {e}" for e in self.errors]
        out.append(f"{len(self.errors)} errors")
        return out


class _CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: names the target, and is never asked to launch."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):  # noqa: ANN201 (triton's GPUTarget)
        return self.target

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compile_only(arch: int, report: Report, every_config: bool = True) -> Iterator[None]:
    """Inside, a kernel launch compiles for sm_<arch> and returns without running. An autotuned launch compiles
    its configurations in order, all of them (every_config) or until one fits the target's shared memory (what
    the autotuner needs; the configurations of a kernel differ in block sizes, not code), and fails if none fits."""
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    limit = MAX_SHARED_BYTES.get(arch)
    jit_run, tuned_run = JITFunction.run, Autotuner.run

    tuning = []  # non-empty while an autotuner compiles its configurations (one of them may not fit)

    def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202 (triton's signature)
        kernel = jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        report.shared.setdefault(self.fn.__name__, set()).add(kernel.metadata.shared)
        if not tuning and not fits(kernel):  # a plain launch of it would fail on the GPU
            raise RuntimeError(
                f"{self.fn.__name__}: needs {kernel.metadata.shared} bytes of shared memory, over {limit}"
            )
        return kernel

    def fits(kernel) -> bool:  # noqa: ANN001
        return limit is None or kernel.metadata.shared <= limit

    def tuned(self, *args, **kwargs):  # noqa: ANN001, ANN202
        kernels = []
        tuning.append(self)
        try:
            for config in self.configs:
                kernels.append(self.fn.run(*args, **{**kwargs, **config.all_kwargs()}))
                if fits(kernels[-1]) and not every_config:
                    break
        finally:
            tuning.pop()
        if not any(fits(k) for k in kernels):
            name, sizes = self.fn.fn.__name__, sorted(k.metadata.shared for k in kernels)
            raise RuntimeError(f"{name}: no autotuning config fits {limit} bytes of shared memory {sizes}")
        return next(k for k in kernels if fits(k))

    # The driver in use before (None until a first launch picks one); reset_active() would build the default
    # driver, which raises on a machine without a GPU.
    previous = getattr(driver, "_active", None)
    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run, Autotuner.run = run, tuned
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = jit_run, tuned_run
        driver._active = previous


def _selected(cases: str, ops: Sequence[str] | None) -> list:
    from glm5_hal.parity import CASES

    chosen = [c for c in CASES if not ops or c.op in ops]
    if cases == "all":
        return chosen
    quick, seen = [], set()
    for case in chosen:
        kind = next((w for w in CACHE_FORMAT_WORDS if w in case.name), "")
        if (case.slow and not kind) or (case.op, kind) not in seen:
            quick.append(case)
        seen.add((case.op, kind))
    return quick


def _private_launches() -> list[tuple[str, Callable[[], object]]]:
    """The kernels no public op launches yet (the grouped W8A8 / W4A8 GEMMs), and paths the parity cases do not take
    without a GPU (sparse attention split over keys: its default is one range on a CPU) or not at every setting
    perf/triton_gpu.py times (the indexer's tokens a program): called directly."""
    import torch

    from backends.triton import moe
    from backends.triton import sparse_attention as attention

    rows, experts, n, k = 48, 4, 256, 512
    offsets = torch.tensor([0, 16, 16, 40, 48], dtype=torch.int64)
    x_q = torch.zeros(rows, k, dtype=torch.int8)
    x_scale = torch.ones(rows)
    w_q = torch.zeros(experts, n, k, dtype=torch.int8)
    packed = torch.zeros(experts, n, k // 2, dtype=torch.uint8)
    launches: list[tuple[str, Callable[[], object]]] = []
    for out_dtype in (torch.bfloat16, torch.float32):
        launches += [
            (f"grouped W8A8 -> {out_dtype}", lambda o=out_dtype: moe.grouped_quant_matmul(
                x_q, x_scale, w_q, torch.ones(experts, n), offsets, out_dtype=o)),
            (f"grouped W4A8 per channel -> {out_dtype}", lambda o=out_dtype: moe.grouped_w4a8_matmul(
                x_q, x_scale, packed, torch.ones(experts, n), offsets, out_dtype=o)),
            (f"grouped W4A8 group 128 -> {out_dtype}", lambda o=out_dtype: moe.grouped_w4a8_matmul(
                x_q, x_scale, packed, torch.ones(experts, n, k // 128), offsets, group_size=128, out_dtype=o)),
        ]  # fmt: skip
    # A decode step at GLM-5's dims split into 4 key ranges, and the kernel that merges them.
    table, lens, cu = torch.arange(32, dtype=torch.int32)[None], torch.tensor([2048]).int(), torch.tensor([0, 1]).int()
    for dtype in (torch.bfloat16, torch.float32):
        q, cache = torch.zeros(1, 64, 576, dtype=dtype), torch.zeros(32, 64, 576, dtype=dtype)
        indices = torch.arange(2048, dtype=torch.int32)[None]
        launches.append((f"sparse attention in 4 key ranges, {dtype}", lambda q=q, c=cache, i=indices: (
            attention.sparse_flash_attention(q, c, i, table, lens, cu, 0.1, 512, num_splits=4))))  # fmt: skip
    # The indexer's logits at GLM-5's dims in bf16 with each count of tokens a program perf/triton_gpu.py times.
    from backends.triton import indexer

    q_idx, weights = torch.zeros(8, 32, 128, dtype=torch.bfloat16), torch.ones(8, 32)
    index_args = (table[:, :2], torch.tensor([128]).int(), torch.tensor([0, 8]).int())
    index_cache = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    for count in (1, 2, 4, 8):
        launches.append((f"indexer logits, {count} tokens a program", lambda n=count: (
            indexer.indexer_logits(q_idx, weights, index_cache, *index_args, tokens_per_program=n))))  # fmt: skip
    return launches


def check(arch: int = 90, cases: str = "quick", ops: Sequence[str] | None = None, verbose: bool = False) -> Report:
    """Run the selected parity cases (fp32 and bf16) through the triton backend's ops, each launch compiled for
    sm_<arch>; -> what compiled and what failed."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the compile check needs Triton's GPU compiler; unset it")
    import torch

    from backends.triton import BACKEND as TRITON
    from backends.triton.ops import OPS
    from glm5_hal.parity.runner import case_generator, run_inputs
    from glm5_hal.registry import Availability, registry

    report = Report(arch)
    backend = dataclasses.replace(  # the triton backend as it is (its ops, cache formats, delegates), on CPU tensors
        TRITON,
        name=CHECK_BACKEND,
        summary=f"the triton backend's ops, compiled for sm_{arch} and not run",
        probe=lambda: Availability(True, f"compile-only sm_{arch}", ("cpu",)),
        load_ops=lambda: OPS,
        auto_priority=None,
    )
    registry().register(backend)
    try:
        with compile_only(arch, report, every_config=cases == "all"):
            for case in _selected(cases, ops):
                for dtype in (torch.float32, torch.bfloat16):
                    start = time.perf_counter()
                    inputs = case.build(case_generator(case, dtype, 0), dtype)
                    result = run_inputs(case.op, inputs, CHECK_BACKEND, dtype, device="cpu", name=case.name)
                    report.cases += 1
                    if result.status == "error":  # a "fail" is expected: nothing ran, the outputs are garbage
                        lines = result.detail.strip().splitlines() or [""]
                        last = f" ... {lines[-1]}" if len(lines) > 1 else ""
                        report.errors.append(f"{case.op}/{case.name} {dtype}: {lines[0][:300]}{last[:300]}")
                    if verbose:
                        print(f"{time.perf_counter() - start:6.1f} s  {case.op}/{case.name} {dtype}", flush=True)
            for name, launch in _private_launches() if not ops else []:
                try:
                    launch()
                except Exception as exc:
                    report.errors.append(f"{name}: {type(exc).__name__}: {str(exc).strip()[:300]}")
                report.cases += 1
    finally:
        registry().unregister(CHECK_BACKEND)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    parser.add_argument("--cases", choices=("quick", "all"), default="quick")
    parser.add_argument("--ops", nargs="*", help="only these ops (default: every op the parity cases cover)")
    parser.add_argument("--verbose", action="store_true", help="one line per case run, with its compile time")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = check(args.arch, args.cases, args.ops, args.verbose)
    print("\n".join(report.lines()))
    print(f"({time.perf_counter() - start:.0f} s)")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
