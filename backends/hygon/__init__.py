"""The `hygon` backend: Hygon DCU, through the portable paths (glm5_hal.vendors).

Hygon's DTK torch is a ROCm/HIP build that presents the DCU as `cuda` (torch.version.hip set, torch.__hcu_version__).
"""

from glm5_hal.vendors import VendorSpec, vendor_backend

SPEC = VendorSpec(
    name="hygon",
    vendor="Hygon DCU",
    device_type="cuda",
    torch_module=None,
    torch_attr="__hcu_version__",
    smi="hy-smi",
    triton_module="triton",
    presents_as_cuda=True,
)

BACKEND = vendor_backend(SPEC)
