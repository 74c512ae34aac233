"""What every Ascend op adapter needs besides layouts: the torch_npu module, the portable fallback, and weights
prepared once for the fused kernels.

- `npu()`: the torch_npu module the probe imported (the adapters only run after a successful probe).
- `portable(op, reason)`: the `torch` backend's implementation, fetched through the registry (a backend never imports
  another backend). Adapters use it for inputs the fused kernel does not take (fp32 activations, shapes outside a
  kernel's documented range); `NOTES` in backends/ascend/__init__.py lists those cases for `glm5-hal info`.
- `PreparedWeights`: a weight transposed / cast to FRACTAL_NZ / repacked for a kernel is computed on first use and
  reused while the weight tensor is alive and unmodified (same storage, same version counter).
- `write_cache_rows`: the contract's cache write (slot -1 = skip) through npu_scatter_nd_update_.
"""

from __future__ import annotations

import importlib
import logging
import threading
import weakref
from collections.abc import Callable, Hashable
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


def _stamp(weight: Tensor) -> tuple:
    """What must not change for a prepared copy of `weight` to stay valid."""
    try:
        version = weight._version
    except RuntimeError:  # inference-mode tensors have no version counter; they cannot be modified in place
        version = None
    return (version, weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype, weight.device)


class PreparedWeights:
    """Per-weight cache of kernel-ready copies: `get(weight, purpose, prepare)` runs `prepare(weight)` once.

    Entries are keyed by the weight's identity and dropped when the weight is garbage-collected; an in-place update
    of the weight (its version counter moves) or a new storage makes the next `get` prepare it again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, Hashable], tuple[weakref.ref, tuple, object]] = {}

    def get(self, weight: Tensor, purpose: Hashable, prepare: Callable[[Tensor], object]) -> object:
        key = (id(weight), purpose)
        stamp = _stamp(weight)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is weight and entry[1] == stamp:
                return entry[2]
        prepared = prepare(weight)
        with self._lock:
            ref = weakref.ref(weight, lambda _, key=key: self._forget(key))
            self._entries[key] = (ref, stamp, prepared)
        return prepared

    def _forget(self, key: tuple[int, Hashable]) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


PREPARED = PreparedWeights()


def half_or_bf16(*tensors: Tensor) -> bool:
    """True if every tensor is bf16 or fp16: the activation dtypes the fused kernels take."""
    return all(t.dtype in (torch.bfloat16, torch.float16) for t in tensors)


def write_cache_rows(cache: Tensor, slot_mapping: Tensor, rows: Tensor) -> None:
    """cache [blocks, bs, D] (contiguous) gets rows [T, D] at slot_mapping [T] int64; slot -1 is not written."""
    keep = slot_mapping >= 0  # boolean selection: one host sync for the number of written rows
    npu().npu_scatter_nd_update_(
        cache.view(-1, cache.shape[-1]), slot_mapping[keep].view(-1, 1), rows[keep].to(cache.dtype)
    )
