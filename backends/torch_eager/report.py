"""The torch backend's set-up (`prepare`) and its section of `glm5-hal info`: the GEMM routes the probe chose per
device (capabilities.py) and the native CPU kernels' state (native/build.py), as text lines and as JSON
(glm5_hal.registry.BackendReport)."""

from __future__ import annotations

import torch

from backends.torch_eager.capabilities import capabilities, native_isas
from backends.torch_eager.native import (
    amx_gemm,
    bf16_gemm,
    build,
    indexer_scores,
    int8_gemm,
    quantized_index_scores,
    sparse_attention,
)
from backends.torch_eager.native import topk as native_topk
from glm5_hal.registry import BackendReport


def fast_paths() -> dict[str, dict[str, object]]:
    """Per device torch can use here (the CPU, every CUDA device): the probe's choices, or the error that stopped
    it (a bad GLM5_HAL_FAST_PATHS value)."""
    found: dict[str, dict[str, object]] = {}
    for device in ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]:
        try:
            found[device] = capabilities(device).as_dict()
        except ValueError as exc:
            found[device] = {"error": str(exc)}
    return found


def native_kernels() -> dict[str, object]:
    """The native kernels' state: on or off, the build cache (and why it is where it is, or why there is none), and
    each kernel build the routes use on this CPU, asked for here (built on first use): loaded, or why not."""
    # Every build a native route may take. AMX's: its GEMM, and sparse attention's and the indexer's own AMX kernels
    # (amx_attention.c, amx_index_scores.c, amx_quantized_index_scores.c: those modules pick them for the AMX build).
    fused = (sparse_attention, indexer_scores, quantized_index_scores)
    for isa in native_isas():
        for module in (amx_gemm, *fused) if isa == amx_gemm.FAST else (bf16_gemm, *fused):
            module.availability(isa)  # the answer lands in build.status()
    for module in (int8_gemm, native_topk):
        module.availability()
    return build.status()


def prepare(device: torch.device) -> None:
    """The backend's one-time set-up for `device`: the probe's decisions (read from the probe store, else measured and
    kept) and, on CPUs, the native kernels those decisions use (built or loaded)."""
    capabilities(torch.device(device))
    if torch.device(device).type == "cpu":
        native_kernels()


def report() -> BackendReport:
    data = {"fast_paths": fast_paths(), "native_kernels": native_kernels()}
    lines = ["fast GEMM paths of the torch backend (GLM5_HAL_FAST_PATHS: auto, 0 = conservative fp32, 1 = all)"]
    for device, choice in data["fast_paths"].items():
        lines += [f"  {line}" for line in choice.get("summary", [f"{device}: {choice.get('error')}"])]
    native = data["native_kernels"]
    state = {"on": "on", "off": "off (GLM5_HAL_NATIVE)", "portable": "portable builds only (GLM5_HAL_NATIVE)"}[
        native["mode"]
    ]
    lines.append(
        f"native CPU kernels (backends/torch_eager/native): {state}; build cache {native['cache_dir'] or 'none'}"
    )
    if native["cache_note"]:
        lines.append(f"  cache: {native['cache_note']}")
    width = max(map(len, native["kernels"]), default=0)  # the longest build name, so the reasons line up
    lines += [f"  {kernel:<{width}} {how}" for kernel, how in native["kernels"].items()]
    return BackendReport(tuple(lines), data)
