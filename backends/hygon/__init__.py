"""The `hygon` backend: Hygon DCU (DTK / ROCm).

Not built yet (issue #4); registered so selection can say so."""

from glm5_hal.registry import unavailable_backend

BACKEND = unavailable_backend(
    "hygon",
    "Hygon DCU (DTK / ROCm)",
    "not implemented yet in this version of glm5-hal (tracked in issue #4)",
)
