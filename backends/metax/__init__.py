"""The `metax` backend: MetaX GPUs (MACA) through MetaX's published kernels where their documented semantics
express the contract, and the portable torch / triton paths for everything else (glm5_hal.vendors).

[detect: GLM5_HAL_VENDOR, mx-smi (MACA's torch presents the GPU as `cuda`)] -> [portable table]
    + [ops: sparse_flash_attention (mcFlashMLA), lightning_indexer's top-k, moe_gate, dynamic_quant, quant_matmul
       (mcoplib)] over [runtime: bounded imports, op namespaces, portable fallback]

Importing this package imports no MetaX library: they are imported when the ops load, and a missing one leaves
its ops on the portable path with the reason in `glm5-hal info`. docs/vendors.md maps every op to its kernel and
says what is validated without hardware.
"""

from collections.abc import Callable, Mapping

from glm5_hal.kv_formats import FORMATS
from glm5_hal.registry import Backend, BackendReport
from glm5_hal.vendors import VendorSpec, vendor_backend

SPEC = VendorSpec(
    name="metax",
    vendor="MetaX",
    device_type="cuda",
    torch_module=None,
    torch_attr=None,
    smi="mx-smi",
    triton_module="triton",
    presents_as_cuda=True,
)

# Detection, availability and the portable table (triton where the vendor's Triton compiles, else torch).
_PORTABLE = vendor_backend(SPEC)

NOTES = (
    "MetaX kernels (mcoplib, mcFlashMLA) where their documented semantics express the contract; every other op, "
    "and inputs outside a kernel's documented range, on the portable torch / triton path (per-op list below)",
    "lightning_indexer: fast_topk does not document which of exactly tied keys it keeps; the contract's "
    "lower-position rule is guaranteed on the portable path only (GLM5_HAL_OP_BACKENDS=lightning_indexer=torch)",
    "validated here only against a strict fake of the published schemas (docs/vendors.md), not on MetaX hardware",
)

_delegates: dict[str, str] = {}


def _load_ops() -> Mapping[str, Callable]:
    from backends.metax.ops import vendor_ops

    portable = dict(_PORTABLE.load_ops())
    mapped = vendor_ops(portable)
    _delegates.clear()
    _delegates.update({op: how for op, how in _PORTABLE.delegates.items() if op not in mapped})
    return {**portable, **mapped}


def _report() -> BackendReport:
    from backends.metax.ops import routes

    table = routes()
    lines = ["metax kernels (per op: the MetaX kernel that runs where inputs fit, or why the portable path runs)"]
    for op, route in table.items():
        lines.append(f"  {op}: {route['kernel']}" if route["kernel"] else f"  {op}: portable ({route['why']})")
    return BackendReport(tuple(lines), {"kernels": table})


BACKEND = Backend(
    name=SPEC.name,
    summary=f"{SPEC.vendor} ({SPEC.device_type}): mcoplib / mcFlashMLA kernels where they fit, portable paths else",
    probe=_PORTABLE.probe,
    load_ops=_load_ops,
    auto_priority=_PORTABLE.auto_priority,
    delegates=_delegates,
    notes=NOTES,
    kv_cache_dtypes=tuple(FORMATS),
    report=_report,
)
