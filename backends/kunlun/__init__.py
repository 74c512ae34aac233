"""The `kunlun` backend: Kunlunxin XPU through vllm-kunlun 0.11.1's kernels where their documented semantics
express the contract, and the portable torch / triton paths for everything else (glm5_hal.vendors).

[detect: GLM5_HAL_VENDOR, xpu-smi (Kunlunxin's torch presents the XPU as `cuda`)] -> [portable table]
    + [ops: sparse_flash_attention (attention), indexer_logits / lightning_indexer over int8_index keys (indexer),
       moe_gate / grouped_matmul / moe_combine / fused_moe (moe), dynamic_quant / quant_matmul (quant)]
    over [runtime: the `_C` wrappers of vllm-kunlun, imported bounded when the ops load; portable fallback]

Importing this package imports neither vllm-kunlun nor kunlun_ops. docs/vendors.md maps every op to its kernel and
says what is validated without hardware.
"""

from glm5_hal.vendors import VendorKernels, VendorSpec, tuned_vendor_backend

SPEC = VendorSpec(
    name="kunlun",
    vendor="Kunlunxin XPU",
    device_type="cuda",
    torch_module=None,
    torch_attr=None,
    smi="xpu-smi",
    triton_module="triton",
    presents_as_cuda=True,
)

NOTES = (
    "vllm-kunlun 0.11.1 kernels (torch.ops._C) where their documented semantics express the contract; every other "
    "op, and inputs outside a kernel's documented range, on the portable torch / triton path (per-op list below)",
    "lightning_indexer: fast_topkv2 (topk 2048) does not document which of exactly tied keys it keeps; the "
    "contract's lower-position rule is guaranteed on the portable path (GLM5_HAL_OP_BACKENDS=lightning_indexer=torch)",
    "the indexer kernels take int8 queries: bf16 queries over an int8_index cache are quantized per (token, head), "
    "an error within bf16's tolerance",
    "validated here only against a strict fake of vllm-kunlun 0.11.1's wrapper schemas (docs/vendors.md), not on a "
    "Kunlunxin XPU",
)


def _kernel_table():
    from backends.kunlun import ops  # the adapters, imported when the ops load

    return ops


BACKEND = tuned_vendor_backend(
    SPEC,
    VendorKernels(
        summary=f"{SPEC.vendor} ({SPEC.device_type}): vllm-kunlun kernels where they fit, portable paths else",
        notes=NOTES,
        table=_kernel_table,
    ),
)
