"""What every MetaX adapter needs: the vendor libraries (imported lazily and bounded, never at `import glm5_hal`),
their torch.ops namespaces, and the portable fallback.

    mcoplib._C           -> torch.ops._C           dynamic_scaled_int8_quant, cutlass_scaled_mm (vLLM's ops)
    mcoplib._moe_C       -> torch.ops._moe_C       grouped_topk
    mcoplib.sgl_kernel   -> torch.ops.sgl_kernel   fast_topk, moe_fused_gate (sglang's ops)
    flash_mla            -> Python functions       flash_mla_sparse_fwd, get_mla_metadata, flash_mla_with_kvcache

A test double of `mcoplib` may carry GLM5_HAL_OP_NAMESPACES = {real namespace: its own}: the fake's ops live in
namespaces of their own, so that they never collide with a real vLLM `_C` or another vendor's fake in one process.
The real mcoplib never has the attribute.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

import torch

from glm5_hal.probing import import_bounded

log = logging.getLogger("glm5_hal.metax")

NAMESPACES_ATTR = "GLM5_HAL_OP_NAMESPACES"
LIBRARIES: dict[str, str | None] = {
    "mcoplib._C": "_C",
    "mcoplib._moe_C": "_moe_C",
    "mcoplib.sgl_kernel": "sgl_kernel",
    "flash_mla": None,  # mcFlashMLA: pybind functions behind a Python interface, no torch.ops namespace
}
INSTALL_HINT = "build mcoplib / mcFlashMLA from MetaX-MACA's repositories (not on PyPI) against MACA's torch"


class _State:
    """Set by load_ops: the portable ops (the vendor backend's torch / triton table) and which libraries import."""

    portable: Mapping[str, Callable] = {}
    modules: dict[str, ModuleType] = {}
    missing: dict[str, str] = {}
    namespaces: dict[str, str] = {}


STATE = _State()


def load_libraries(portable_ops: Mapping[str, Callable]) -> None:
    """Import each vendor library (bounded, never raising) and remember the portable ops; called by load_ops."""
    STATE.portable = dict(portable_ops)
    STATE.modules, STATE.missing = {}, {}
    for name in LIBRARIES:
        outcome = import_bounded(name)
        if outcome.value is not None:
            STATE.modules[name] = outcome.value
        else:
            STATE.missing[name] = f"{outcome.reason or f'{name} did not import'}; {INSTALL_HINT}"
    package = sys.modules.get("mcoplib")
    STATE.namespaces = dict(getattr(package, NAMESPACES_ATTR, {}) or {})


def available(library: str) -> tuple[bool, str]:
    """(whether `library` imported, why not)."""
    return library in STATE.modules, STATE.missing.get(library, "")


def kernel(library: str, name: str) -> Callable:
    """torch.ops.<library's namespace>.<name> (the namespace a test double redirects it to, if any)."""
    namespace = LIBRARIES[library]
    if namespace is None:
        return getattr(STATE.modules[library], name)
    return getattr(getattr(torch.ops, STATE.namespaces.get(namespace, namespace)), name)


_logged: set[tuple[str, str]] = set()


def portable(op: str, reason: str) -> Callable:
    """The portable implementation of `op` (what the metax backend runs without vendor kernels), for inputs the
    vendor kernel cannot take; logs `reason` once per (op, reason)."""
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        log.debug("metax: %s runs the portable path: %s", op, reason)
    return STATE.portable[op]
