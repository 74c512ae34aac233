"""Tile shapes of the GEMM kernels: timed on the GPU by Triton's autotuner, fixed under the interpreter.

Every GEMM kernel of this backend (batched_matmul_into, quant_matmul, w4a8_matmul, and the grouped bf16 / W8A8 / W4A8
expert GEMMs) takes BLOCK_N x BLOCK_K tiles and its caller's BLOCK_M (the grouped ones build their expert tile index
for it before the launch). Until 2026-11-30 each ran one fixed shape (BLOCK_N 128, BLOCK_K 64 or 32, Triton's 4
warps and 3 stages); on an H200 the grouped bf16 GEMM reached 34% of a dense torch.matmul of the same FLOPs and the
grouped W8A8 1.17x the bf16 one (docs/backends.md), with int8 tiles as deep along K as bf16 ones. Now, on a GPU, the
autotuner times each kernel over the shapes below once per (N, K, BLOCK_M, dtypes; a W4A8 kernel's group size too)
and keeps the fastest for the process. The first shape of each list is the old fixed one, so the autotuner never
keeps a shape it measured slower than that. Shapes that need more shared memory than the GPU has fail to compile
and are skipped (e.g. 256-wide bf16 tiles over 3 stages on sm_86 / 89). Under the interpreter, whose cost is per
program and per step, `launch_gemm` takes its caller's wide fixed tiles instead (the autotuner would time every
shape in Python). None of these shapes has been timed on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Callable

import triton

from backends.triton.runtime import interpreting

# (BLOCK_N, BLOCK_K, num_warps, num_stages); the first of each list is the shape each kernel ran with before.
TILE_SHAPES = {
    # bf16 / fp16 activations: wider N tiles and 8 warps for Hopper's warpgroup MMA, deeper K.
    "half": [(128, 64, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 4, 4)],
    # fp32 activations (two dots on their hi + lo halves, or fp32 operands): K tiles half as deep per byte.
    "float32": [(128, 32, 4, 3), (128, 32, 8, 3), (64, 32, 4, 4), (128, 64, 8, 2)],
    # int8 x int8 (and unpacked int4): twice the K of a bf16 tile in the same bytes.
    "int8": [(128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (256, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4)],
}


# The autotuned form of each kernel, by (kernel, shape list): made once each, for the process.
_made: dict[tuple[triton.JITFunction, str], triton.runtime.Autotuner] = {}


def _autotuned(kernel: triton.JITFunction, shapes: str) -> triton.runtime.Autotuner:
    """The autotuned form of `kernel` over TILE_SHAPES[shapes]."""
    if (kernel, shapes) not in _made:
        configs = [
            triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
            for n, k, warps, stages in TILE_SHAPES[shapes]
        ]
        # The kernels only write their output, so a timed run leaves nothing to restore; the dtypes of the tensor
        # arguments are part of the key without being named, and a W4A8 kernel's group size is named.
        key = [name for name in ("N", "K", "BLOCK_M", "group_size") if name in kernel.arg_names]
        _made[kernel, shapes] = triton.autotune(configs, key=key)(kernel)
    return _made[kernel, shapes]


def launch_gemm(
    kernel: triton.JITFunction,
    shapes: str,
    grid: Callable[[int], tuple[int, ...]],
    interpreted_blocks: dict[str, int],
    **arguments: object,
) -> None:
    """Launch a GEMM `kernel` (arguments N, K and BLOCK_M among `arguments`, meta-parameters BLOCK_N and BLOCK_K
    left out) over grid(BLOCK_N): autotuned over TILE_SHAPES[shapes] ("half", "float32" or "int8") on a GPU, with
    interpreted_blocks (BLOCK_N and BLOCK_K) under the interpreter."""
    if interpreting():
        kernel[grid(interpreted_blocks["BLOCK_N"])](**arguments, **interpreted_blocks)
    else:
        _autotuned(kernel, shapes)[lambda meta: grid(meta["BLOCK_N"])](**arguments)


def float_shapes(x_dtype_is_fp32: bool) -> str:
    """The TILE_SHAPES list of a float GEMM whose activations are fp32 or not."""
    return "float32" if x_dtype_is_fp32 else "half"


def chosen_shapes() -> list[str]:
    """A line per GEMM kernel and key the autotuner has timed in this process: the tile shape it kept, as
    (BLOCK_N, BLOCK_K, warps, stages). What perf/triton_gpu.py prints, to prune or extend TILE_SHAPES from."""
    lines = []
    for (kernel, shapes), tuned in _made.items():
        for key, config in sorted(tuned.cache.items(), key=str):
            shape = (config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.num_warps, config.num_stages)
            named = ", ".join(f"{name}={value}" for name, value in zip(tuned.keys, key))
            dtypes = ", ".join(str(v).removeprefix("torch.") for v in key[len(tuned.keys) :])
            first = " (the old fixed shape)" if shape == TILE_SHAPES[shapes][0] else ""
            lines.append(f"{kernel.fn.__name__} [{shapes}] {named} ({dtypes}): {shape}{first}")
    return lines
