"""The `ascend` backend: Huawei Ascend through torch_npu's fused ops.

Not built yet (issue #4); registered so selection can say so."""

from glm5_hal.registry import unavailable_backend

BACKEND = unavailable_backend(
    "ascend",
    "Huawei Ascend through torch_npu's fused ops",
    "not implemented yet in this version of glm5-hal (tracked in issue #4)",
)
