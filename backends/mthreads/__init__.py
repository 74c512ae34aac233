"""The `mthreads` backend: Moore Threads MUSA, through the portable paths (glm5_hal.vendors).

torch_musa adds the `musa` device; FlagTree ships a Moore Threads Triton.
"""

from glm5_hal.vendors import VendorSpec, vendor_backend

SPEC = VendorSpec(
    name="mthreads",
    vendor="Moore Threads MUSA",
    device_type="musa",
    torch_module="torch_musa",
    torch_attr="musa",
    smi="mthreads-gmi",
    triton_module="triton",
    presents_as_cuda=False,
)

BACKEND = vendor_backend(SPEC)
