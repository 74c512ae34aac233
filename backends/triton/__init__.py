"""The `triton` backend: Triton kernels (CUDA, ROCm/Hygon DCU, vendor Triton toolchains).

Not built yet (issue #3); registered so selection can say so."""

from glm5_hal.registry import unavailable_backend

BACKEND = unavailable_backend(
    "triton",
    "Triton kernels (CUDA, ROCm/Hygon DCU, vendor Triton toolchains)",
    "not implemented yet in this version of glm5-hal (tracked in issue #3)",
)
