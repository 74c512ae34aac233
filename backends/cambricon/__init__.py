"""The `cambricon` backend: Cambricon MLU, through the portable paths (glm5_hal.vendors).

torch_mlu adds the `mlu` device; FlagTree ships a Cambricon Triton.
"""

from glm5_hal.vendors import VendorSpec, vendor_backend

SPEC = VendorSpec(
    name="cambricon",
    vendor="Cambricon MLU",
    device_type="mlu",
    torch_module="torch_mlu",
    torch_attr="mlu",
    smi="cnmon",
    triton_module="triton",
    presents_as_cuda=False,
)

BACKEND = vendor_backend(SPEC)
