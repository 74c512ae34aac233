"""The `metax` backend: MetaX GPUs (MACA) through MetaX's published kernels where their documented semantics
express the contract, and the portable torch / triton paths for everything else (glm5_hal.vendors).

[detect: GLM5_HAL_VENDOR, mx-smi (MACA's torch presents the GPU as `cuda`)] -> [portable table]
    + [ops: sparse_flash_attention (mcFlashMLA), lightning_indexer's top-k, moe_gate, dynamic_quant, quant_matmul
       (mcoplib)] over [runtime: bounded imports, op namespaces, portable fallback]

Importing this package imports no MetaX library: they are imported when the ops load, and a missing one leaves
its ops on the portable path with the reason in `glm5-hal info`. docs/vendors.md maps every op to its kernel and
says what is validated without hardware.
"""

from glm5_hal.vendors import VendorKernels, VendorSpec, tuned_vendor_backend

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

NOTES = (
    "MetaX kernels (mcoplib, mcFlashMLA) where their documented semantics express the contract; every other op, "
    "and inputs outside a kernel's documented range, on the portable torch / triton path (per-op list below)",
    "lightning_indexer: fast_topk does not document which of exactly tied keys it keeps; the contract's "
    "lower-position rule is guaranteed on the portable path only (GLM5_HAL_OP_BACKENDS=lightning_indexer=torch)",
    "validated here only against a strict fake of the published schemas (docs/vendors.md), not on MetaX hardware",
)


def _kernel_table():
    from backends.metax import ops  # the adapters, imported when the ops load

    return ops


BACKEND = tuned_vendor_backend(
    SPEC,
    VendorKernels(
        summary=f"{SPEC.vendor} ({SPEC.device_type}): mcoplib / mcFlashMLA kernels where they fit, portable paths else",
        notes=NOTES,
        table=_kernel_table,
    ),
)
