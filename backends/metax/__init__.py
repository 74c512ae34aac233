"""The `metax` backend: MetaX, through the portable paths (glm5_hal.vendors).

MetaX's MACA torch presents the GPU as `cuda`; only the mx-smi command tells it apart.
"""

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

BACKEND = vendor_backend(SPEC)
