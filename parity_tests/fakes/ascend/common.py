"""What every kernel of the strict torch_npu fake shares: the error type, host conversion, poison values, state.

A fake kernel (1) rejects what torch_npu 2.14.0's documentation forbids with a FakeNpuError naming the op and the
rule, (2) computes the documented result in float64 (with ops_reference where the formula is the contract's), and
(3) fills outputs the documentation leaves undefined with a poison value (NaN, or an out-of-range code), so an
adapter that relies on undefined behaviour fails its parity test instead of passing by luck.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from torch import Tensor

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
INT8_POISON = -128  # outside the symmetric [-127, 127] range every documented quantizer produces


class FakeNpuError(RuntimeError):
    """A call the torch_npu 2.14.0 documentation forbids (or that this fake does not model)."""


def require(condition: bool, op: str, rule: str) -> None:
    if not condition:
        raise FakeNpuError(f"{op}: {rule} [strict torch_npu 2.14.0 fake]")


def not_modeled(condition: bool, op: str, what: str) -> None:
    """For documented features the glm5-hal backend does not use: refuse rather than guess their semantics."""
    if not condition:
        raise FakeNpuError(
            f"{op}: {what} is documented but not modeled by this fake; the glm5-hal backend must not use it"
        )


def host(t: Tensor) -> np.ndarray:
    """A float64 (floating tensors) or int64 (integer tensors) NumPy copy."""
    t = t.detach().cpu()
    return (t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)).numpy()


def device_tensor(a: np.ndarray, dtype: torch.dtype, like: Tensor) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=like.device, dtype=dtype)


def poison(shape: tuple[int, ...], dtype: torch.dtype, like: Tensor) -> Tensor:
    """An output the documentation leaves undefined: NaN for floats, INT8_POISON / -1 for integers."""
    fill = float("nan") if dtype.is_floating_point else (INT8_POISON if dtype == torch.int8 else -1)
    return torch.full(shape, fill, dtype=dtype, device=like.device)


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


class State:
    """Calls per op (tests assert the fused kernels really ran) and nothing else; reset between tests."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def reset(self) -> None:
        self.calls.clear()


STATE = State()
