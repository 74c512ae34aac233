"""The `mthreads` backend: Moore Threads MUSA (torch_musa).

Not built yet (issue #4); registered so selection can say so."""

from glm5_hal.registry import unavailable_backend

BACKEND = unavailable_backend(
    "mthreads",
    "Moore Threads MUSA (torch_musa)",
    "not implemented yet in this version of glm5-hal (tracked in issue #4)",
)
