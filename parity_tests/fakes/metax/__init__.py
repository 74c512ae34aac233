"""A strict fake of MetaX's mcoplib and mcFlashMLA for testing the `metax` backend without MetaX hardware (test tree
only, not shipped).

[schemas: the TORCH_LIBRARY strings (and mcFlashMLA's pybind signatures) written into schemas.py with their source
and commit] -> each op defined with torch.library in a namespace of its own (fakes/schema_fake.define_ops), so
PyTorch refuses what the real schema refuses -> CPU kernels (mcoplib.py, flash_mla.py) that refuse what the
sources' checks refuse and compute the documented result with ops_reference -> modules `mcoplib` (carrying
GLM5_HAL_OP_NAMESPACES, the redirect backends/metax/runtime.py honours), `mcoplib._C`, `mcoplib._moe_C`,
`mcoplib.sgl_kernel` and `flash_mla` (the Python interface, over the fake flash_mla_cuda ops).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from fakes.metax import flash_mla, mcoplib
from fakes.metax.schemas import NAMESPACES, SCHEMAS
from fakes.schema_fake import CallCounter, define_ops

KERNELS = {
    "_C": {
        "dynamic_scaled_int8_quant": mcoplib.dynamic_scaled_int8_quant,
        "cutlass_scaled_mm": mcoplib.cutlass_scaled_mm,
    },
    "_moe_C": {"grouped_topk": mcoplib.grouped_topk},
    "sgl_kernel": {"fast_topk": mcoplib.fast_topk, "moe_fused_gate": mcoplib.moe_fused_gate},
    "flash_mla_cuda": {
        "sparse_prefill_fwd": flash_mla.sparse_prefill_fwd,
        "fwd_kvcache_mla": flash_mla.fwd_kvcache_mla,
        "get_mla_metadata": flash_mla.get_mla_metadata,
    },
}
CALLS = CallCounter()
MODULES = ("mcoplib", "mcoplib._C", "mcoplib._moe_C", "mcoplib.sgl_kernel", "flash_mla")


def ops(namespace: str) -> object:
    """torch.ops of the fake's namespace standing in for MetaX's `namespace`."""
    return getattr(torch.ops, NAMESPACES[namespace])


@functools.cache
def build() -> dict[str, ModuleType]:
    """{module name: fake module} (built once per process: torch.library definitions are global)."""
    libraries = [define_ops(NAMESPACES[ns], SCHEMAS[ns], KERNELS[ns], CALLS) for ns in SCHEMAS]
    package = ModuleType("mcoplib", "glm5-hal strict fake of MetaX's mcoplib")
    package.__path__ = []  # a package, so that `import mcoplib._C` finds the submodules in sys.modules
    package.GLM5_HAL_OP_NAMESPACES = {ns: NAMESPACES[ns] for ns in ("_C", "_moe_C", "sgl_kernel")}
    package._libraries = libraries  # keeps the definitions alive
    package.calls = CALLS.calls
    modules = {"mcoplib": package}
    for name in ("_C", "_moe_C", "sgl_kernel"):
        modules[f"mcoplib.{name}"] = ModuleType(f"mcoplib.{name}", f"fake: its ops are torch.ops.{NAMESPACES[name]}")
        setattr(package, name, modules[f"mcoplib.{name}"])
    modules["flash_mla"] = flash_mla.interface(ops("flash_mla_cuda"))
    return modules
