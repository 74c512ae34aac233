"""What every kernel of the strict torch_npu fake shares: the error type, host conversion, poison values, state.

A fake kernel (1) rejects what torch_npu 2.14.0's documentation forbids with a FakeNpuError naming the op and the
rule, (2) computes the documented result in float64 (with ops_reference where the formula is the contract's), and
(3) fills outputs the documentation leaves undefined with a poison value (NaN, or an out-of-range code), so an
adapter that relies on undefined behaviour fails its parity test instead of passing by luck.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fakes.schema_fake import (  # noqa: F401 (INT8_POISON, device_tensor, host, poison: re-exported)
    INT8_POISON,
    CallCounter,
    device_tensor,
    host,
    poison,
    rule_checks,
)

# c10::ScalarType codes: how torch.ops passes a torch.dtype to an `int?` schema argument (output_dtype, ...).
SCALAR_TYPES: dict[int, torch.dtype] = {
    0: torch.uint8,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    11: torch.bool,
    15: torch.bfloat16,
}
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class FakeNpuError(RuntimeError):
    """A call the torch_npu 2.14.0 documentation forbids (or that this fake does not model)."""


# not_modeled: a feature torch_npu documents that the glm5-hal backend does not use.
require, not_modeled = rule_checks(
    FakeNpuError, "strict torch_npu 2.14.0 fake", "is documented but not modeled by this fake"
)


def is_transposed_2d(t: Tensor) -> bool:
    """A 2-D (or batched) tensor that is the transpose of a contiguous one (torch_npu's "transposed" inputs)."""
    return t.dim() >= 2 and t.transpose(-1, -2).is_contiguous() and not t.is_contiguous()


def mark(t: Tensor, tag: str, value: object = True) -> Tensor:
    """Attach fake metadata (NPU storage format, int4 packing) to a tensor; views inherit it through `_base`."""
    setattr(t, f"_glm5_fake_{tag}", value)
    return t


def marked(t: Tensor, tag: str) -> object:
    base = t
    while base is not None:
        value = getattr(base, f"_glm5_fake_{tag}", None)
        if value is not None:
            return value
        base = base._base
    return None


STATE = CallCounter()
