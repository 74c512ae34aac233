"""The `kunlun` backend: Kunlunxin XPU, through the portable paths (glm5_hal.vendors).

Kunlunxin's own torch build presents the XPU as `cuda`; its vendor Triton wheel imports as `triton`.
"""

from glm5_hal.vendors import VendorSpec, vendor_backend

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

BACKEND = vendor_backend(SPEC)
