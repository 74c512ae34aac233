"""The `triton` backend: Triton kernels for CUDA and ROCm / Hygon DCU GPUs and vendor Triton toolchains.

On a machine with a GPU the kernels compile for it and `auto` prefers them. Without one, Triton's CPU
interpreter runs the same kernels on CPU tensors: that is how CI tests them, it is slow, and `auto` never picks
it (name the backend to use it). The interpreter decision is made before triton is imported (runtime.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from glm5_hal.kv_formats import FORMATS
from glm5_hal.registry import Availability, Backend


def _probe() -> Availability:
    # Find triton without importing it: importing it would fix the compiled-vs-interpreted choice too early.
    if importlib.util.find_spec("triton") is None:
        return Availability(False, "triton is not installed (pip install 'glm5-hal[triton]')")
    from backends.triton.runtime import has_gpu, interpreting

    version = importlib.metadata.version("triton")
    if has_gpu() and not interpreting():
        import torch

        return Availability(True, f"Triton {version} on {torch.cuda.get_device_name()}", ("cuda",))
    return Availability(
        True,
        f"Triton {version} CPU interpreter (TRITON_INTERPRET=1): for testing, slow; no GPU here",
        ("cpu",),
        auto_eligible=False,
        emulated=True,
    )


def _load_ops():
    from backends.triton.runtime import use_interpreter_if_no_gpu

    use_interpreter_if_no_gpu()
    from backends.triton.ops import OPS

    return OPS


BACKEND = Backend(
    name="triton",
    summary="Triton kernels (CUDA, ROCm/Hygon DCU, vendor Triton toolchains); CPU interpreter for tests",
    probe=_probe,
    load_ops=_load_ops,
    auto_priority=20,
    # The expert-parallel exchange is communication, not a kernel: the portable all_to_all_single path runs it.
    delegates={"ep_dispatch": "torch", "ep_combine": "torch"},
    kv_cache_dtypes=tuple(FORMATS),
)
