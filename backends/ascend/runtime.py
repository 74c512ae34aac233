"""What every Ascend op adapter needs besides layouts: the torch_npu module and the portable fallback. Weights the
fused kernels take transposed, in FRACTAL_NZ or repacked are made once per weight (glm5_hal.weight_cache).

- `npu()`: the torch_npu module the probe imported (the adapters only run after a successful probe).
- `portable(op, reason)`: the `torch` backend's implementation, fetched through the registry (a backend never imports
  another backend). Adapters use it for inputs the fused kernel does not take (fp32 activations, shapes outside a
  kernel's documented range); `NOTES` in backends/ascend/__init__.py lists those cases for `glm5-hal info`.
- `write_cache_rows`: the contract's cache write (slot -1 = skip) through npu_scatter_nd_update_.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from glm5_hal.registry import registry
from glm5_hal.selection import FALLBACK_BACKEND

log = logging.getLogger("glm5_hal.ascend")

# aclFormat codes (torch_npu.npu_format_cast): ND is the plain row-major layout; FRACTAL_NZ is the blocked layout
# the cube unit reads fastest, which npu_mla_prolog_v3 requires for its three projection weights.
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29


def npu() -> ModuleType:
    """The imported torch_npu module (real, or the test fake installed in sys.modules)."""
    return importlib.import_module("torch_npu")


_logged: set[tuple[str, str]] = set()


def portable(op: str, reason: str) -> Callable:
    """The `torch` backend's `op`, for inputs the fused kernel cannot take; logs `reason` once per (op, reason)."""
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        log.debug("ascend: %s runs the portable torch path: %s", op, reason)
    return registry().ops(FALLBACK_BACKEND)[op]


def half_or_bf16(*tensors: Tensor) -> bool:
    """True if every tensor is bf16 or fp16: the activation dtypes the fused kernels take."""
    return all(t.dtype in (torch.bfloat16, torch.float16) for t in tensors)


def write_cache_rows(cache: Tensor, slot_mapping: Tensor, rows: Tensor) -> None:
    """cache [blocks, bs, D] (contiguous) gets rows [T, D] at slot_mapping [T] int64; slot -1 is not written."""
    keep = slot_mapping >= 0  # boolean selection: one host sync for the number of written rows
    npu().npu_scatter_nd_update_(
        cache.view(-1, cache.shape[-1]), slot_mapping[keep].view(-1, 1), rows[keep].to(cache.dtype)
    )
