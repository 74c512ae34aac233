"""What every Kunlunxin adapter needs: vllm-kunlun's kernels (registered as torch.ops._C.<name> when its wrapper
module imports), the portable fallback, and the host copies some kernels take.

- `load(portable_ops)`: imports vllm_kunlun.vllm_utils_wrapper (bounded, never raising; it needs vLLM and the closed
  kunlun_ops) and remembers the portable table; called when the ops load, never at `import glm5_hal`.
- `kernel(name)`: torch.ops._C.<name>, or the namespace a test double redirects `_C` to. The real module never
  carries GLM5_HAL_OP_NAMESPACES; the strict fake (parity_tests/fakes/kunlun) does, so that its ops never collide
  with a real vLLM `_C` or with another vendor's fake in the same process.
- `portable(op, reason)`: the `torch` backend's op on the device, for inputs a kernel's documented range does not
  cover (as the Ascend adapters do: one fallback whose behaviour on the device is the torch build's, not the vendor
  Triton's, which nothing has validated on an XPU). Ops with no Kunlun kernel at all keep the vendor table's route.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from glm5_hal.host_reads import host_reads_allowed
from glm5_hal.probing import import_bounded
from glm5_hal.registry import registry
from glm5_hal.selection import FALLBACK_BACKEND

log = logging.getLogger("glm5_hal.kunlun")

WRAPPER_MODULE = "vllm_kunlun.vllm_utils_wrapper"
NAMESPACE = "_C"
NAMESPACES_ATTR = "GLM5_HAL_OP_NAMESPACES"
INSTALL_HINT = "pip install vllm-kunlun==0.11.1 next to Kunlunxin's torch, vLLM and kunlun_ops (Kunlunxin's site)"


class _State:
    """Set by `load`: the portable ops, and whether (or why not) the wrappers imported."""

    portable: Mapping[str, Callable] = {}
    namespace: str = NAMESPACE
    missing: str = "the kunlun ops have not been loaded"


STATE = _State()


def load(portable_ops: Mapping[str, Callable]) -> None:
    """Import vllm-kunlun's wrapper module (bounded) and remember the fallback ops (`portable`)."""
    del portable_ops  # the vendor table's routes serve the unmapped ops; the adapters fall back to torch's
    STATE.portable = registry().ops(FALLBACK_BACKEND)
    outcome = import_bounded(WRAPPER_MODULE)
    if outcome.value is None:
        STATE.missing = f"{outcome.reason or f'{WRAPPER_MODULE} did not import'}; {INSTALL_HINT}"
        return
    STATE.missing = ""
    redirect = getattr(sys.modules.get("vllm_kunlun"), NAMESPACES_ATTR, None) or {}
    STATE.namespace = redirect.get(NAMESPACE, NAMESPACE)


def unavailable() -> str:
    """Why no Kunlun kernel can run here ("" when the wrappers imported)."""
    return STATE.missing


def kernel(name: str) -> Callable:
    """torch.ops._C.<name> (or its test double's namespace)."""
    return getattr(getattr(torch.ops, STATE.namespace), name)


_logged: set[tuple[str, str]] = set()


def portable(op: str, reason: str) -> Callable:
    """The portable `op`, for inputs no Kunlun kernel takes; logs `reason` once per (op, reason)."""
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        log.debug("kunlun: %s runs the portable path: %s", op, reason)
    return STATE.portable[op]


def why_not_kernel(*tensors: Tensor) -> str | None:
    """Why no kernel may run on these inputs whatever their shapes: the wrappers missing, or a graph being captured
    or traced (every Kunlun kernel used here takes host-side lengths, which cannot be read back then)."""
    if STATE.missing:
        return STATE.missing
    if not all(host_reads_allowed(t) for t in tensors):
        return "the kernels take host-side lengths, which may not be read while a graph is captured or traced"
    return None


def on_host(t: Tensor) -> Tensor:
    """A CPU int32 copy: the `*_cpu` lengths the kernels take beside the device ones."""
    return t.to(device="cpu", dtype=torch.int32)
