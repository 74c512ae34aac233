"""The `enflame` backend: Enflame GCU, through the portable paths (glm5_hal.vendors).

torch_gcu adds the `gcu` device; Enflame's Triton is triton_gcu.
"""

from glm5_hal.vendors import VendorSpec, vendor_backend

SPEC = VendorSpec(
    name="enflame",
    vendor="Enflame GCU",
    device_type="gcu",
    torch_module="torch_gcu",
    torch_attr="gcu",
    smi=None,  # FlagGems has no query command for Enflame and vllm-gcu uses the pyefml library instead
    triton_module="triton_gcu",
    presents_as_cuda=False,
)

BACKEND = vendor_backend(SPEC)
