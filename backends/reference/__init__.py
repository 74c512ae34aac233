"""The `reference` backend: the float64 NumPy references (ops_reference) behind the torch API.

Slow and exact: inputs are copied to host float64 arrays, the reference runs, outputs come back in the dtype
and on the device the public op promises. Never picked by `auto`; select it explicitly to cross-check another
backend inside a model (`GLM5_HAL_OP_BACKENDS=sparse_flash_attention=reference`). It is the backend of the
float64 verification mode: with float64 inputs nothing is rounded on the way in or out.
"""

from glm5_hal.kv_formats import FORMATS
from glm5_hal.registry import ANY_DEVICE, Availability, Backend


def _load_ops():
    from backends.reference.expert_parallel import ep_combine, ep_dispatch
    from backends.reference.ops import OPS

    return {**OPS, "ep_dispatch": ep_dispatch, "ep_combine": ep_combine}


BACKEND = Backend(
    name="reference",
    summary="float64 NumPy references (ops_reference) behind the torch API; exact and slow",
    probe=lambda: Availability(True, "NumPy is always available", (ANY_DEVICE,)),
    load_ops=_load_ops,
    auto_priority=None,
    float64=True,
    kv_cache_dtypes=tuple(FORMATS),
)
